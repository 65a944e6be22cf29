"""radixd's one project name and its pair of pluggy markers (re-exported by
``radixd.plugins``; the hook specifications use them without importing the package's
plugin manager)."""

import pluggy

PROJECT = "radixd"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
