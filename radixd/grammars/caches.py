"""The bounded caches of the grammar machinery, two kinds.

``remember``: a plain dict emptied when full, for the many caches whose entries are cheap to
refill (lexers, scans, steps, costs): no recency to track on the hot path. ``lru_get`` /
``lru_put``: an ``OrderedDict`` kept in recency order, for the few whose entries are dear
(masks, vocabulary walks at lexeme starts, token costs, compiled grammars).
"""

from __future__ import annotations

from collections import OrderedDict


def remember(cache: dict, key, value, limit: int):
    """``cache[key] = value``, emptying the cache first when it holds ``limit`` entries (the
    grammar caches are bounded this way: refilling is cheap, tracking recency is not)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def lru_get(cache: OrderedDict, key):
    """``cache[key]`` (marked most recent), or None."""
    got = cache.get(key)
    if got is not None:
        cache.move_to_end(key)
    return got


def lru_put(cache: OrderedDict, key, value, size: int):
    """``cache[key] = value`` as the most recent entry, dropping the least recent beyond ``size``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)
    return value
