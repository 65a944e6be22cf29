"""The built-in drafters, registered through ``radixd_drafters`` like any plugin: ``ngram``
(prompt lookup, here) and ``standalone`` (a draft model: ``radixd.core.speculative.draft_model``).

A request's continuation often repeats its own text: code being edited, a passage quoted or
summarised with quotes, a list being filled. ``ngram`` finds the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from
``speculative_ngram_max_match_window`` down to ``..._min_match_window``, longest first) and
proposes the tokens that followed it there; where there is none, the tokens the radix tree
holds past the whole sequence (what an earlier request with the same text went on with). It
keeps no state: one vectorised scan of the sequence per drafting request and step, and a
read-only walk of the tree.
"""

from __future__ import annotations

import numpy as np

from radixd.core.config import EngineConfig
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request
from radixd.core.speculative.draft_model import DraftModel
from radixd.plugins import hookimpl


class NgramDrafter:
    name = "ngram"

    def __init__(self, config: EngineConfig, cache: RadixCache):
        self.max_n = config.speculative_ngram_max_match_window
        self.min_n = config.speculative_ngram_min_match_window
        self.cache = cache

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, ks, strict=True):
            seq = r.seq
            d = lookup(np.asarray(seq, dtype=np.int64), k, self.min_n, self.max_n)
            out.append(d or self.cache.continuation(seq, r.namespace, k))
        return out


def lookup(seq: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``seq``'s last ``n``
    tokens, for the longest ``n`` in [min_n, max_n] that occurs ([] if none does)."""
    size = len(seq)
    # a match ends where an earlier position holds the last token; check its n - 1 before
    ends = np.flatnonzero(seq[: size - 1] == seq[-1])
    if ends.size == 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        if cand.size == 0:
            continue
        ok = np.ones(cand.size, dtype=bool)
        for j in range(1, n):
            ok &= seq[cand - j] == seq[size - 1 - j]
        hits = cand[ok]
        if hits.size:
            start = int(hits[-1]) + 1
            return seq[start : start + k].tolist()
    return []


@hookimpl
def radixd_drafters():
    return {"ngram": NgramDrafter, "standalone": DraftModel}
