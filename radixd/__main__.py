"""``python -m radixd``: the ``radixd`` command."""

from radixd.cli import main

raise SystemExit(main())
