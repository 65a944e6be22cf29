"""Built-in KV cache tiers, registered as a plugin like any other: ``host`` (memory) and
``disk`` (a directory that survives restarts)."""

from __future__ import annotations

from radixd.core.tiers.disk import DiskTier
from radixd.core.tiers.host import HostTier
from radixd.plugins import hookimpl


@hookimpl
def radixd_cache_tiers():
    return {"host": HostTier, "disk": DiskTier}
