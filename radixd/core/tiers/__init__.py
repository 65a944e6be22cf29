"""Lower tiers of the KV cache: pages of KV kept outside the pool (host memory, disk, plugins).

``base`` holds the tier contract (``CacheTier``), ``Page`` and the page codec shared by tiers
that keep bytes; ``host`` and ``disk`` are the built-in tiers; ``hierarchy.KVHierarchy`` is
what the scheduler talks to (content keys, store, load back, prefetch).
"""

from radixd.core.tiers.base import (
    CacheTier,
    Page,
    PageCorrupt,
    TierContext,
    TierStats,
    decode_page,
    encode_page,
)

__all__ = ["CacheTier", "Page", "PageCorrupt", "TierContext", "TierStats", "decode_page", "encode_page"]
