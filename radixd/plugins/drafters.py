"""The built-in drafters, registered through ``radixd_drafters`` like any plugin: ``ngram``
(prompt lookup, here), ``standalone`` (a draft model: ``radixd.core.speculative.draft_model``)
and ``eagle3`` (an EAGLE-3 draft head on the model's hidden states:
``radixd.core.speculative.eagle3``).

A request's continuation often repeats its own text: code being edited, a passage quoted or
summarised with quotes, a list being filled. ``ngram`` finds the most recent earlier
occurrence of the sequence's last ``n`` tokens (``n`` from
``speculative_ngram_max_match_window`` down to ``..._min_match_window``, longest first) and
proposes the tokens that followed it there; where there is none, the tokens the radix tree
holds past the whole sequence (what an earlier request with the same text went on with). It
keeps no state: one vectorised scan of the sequence per drafting request and step, and a
read-only walk of the tree.

With ``speculative_eagle_topk`` = w > 1 it drafts a token tree: the trie of up to w distinct
continuations, the chain's choice first, then those of earlier occurrences of the same
suffix (latest first, longest suffix first), then the radix tree's.
"""

from __future__ import annotations

import numpy as np

from radixd.core.config import EngineConfig
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request
from radixd.core.speculative.draft_model import DraftModel
from radixd.core.speculative.eagle3 import Eagle3Drafter
from radixd.core.speculative.tree import from_continuations
from radixd.plugins import hookimpl


class NgramDrafter:
    name = "ngram"

    def __init__(self, config: EngineConfig, cache: RadixCache):
        self.max_n = config.speculative_ngram_max_match_window
        self.min_n = config.speculative_ngram_min_match_window
        self.width = config.speculative_eagle_topk
        self.cache = cache

    def propose(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(reqs, ks, strict=True):
            seq = r.seq
            conts = continuations(np.asarray(seq, dtype=np.int64), k, self.min_n, self.max_n, self.width)
            if len(conts) < self.width and (cached := self.cache.continuation(seq, r.namespace, k)):
                if cached not in conts:
                    conts.append(cached)
            out.append(from_continuations(conts) if self.width > 1 else (conts[0] if conts else []))
        return out


def lookup(seq: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``seq``'s last ``n``
    tokens, for the longest ``n`` in [min_n, max_n] that occurs ([] if none does)."""
    found = continuations(seq, k, min_n, max_n, 1)
    return found[0] if found else []


def continuations(seq: np.ndarray, k: int, min_n: int, max_n: int, width: int) -> list[list[int]]:
    """Up to ``width`` distinct runs of up to ``k`` tokens that followed earlier occurrences
    of ``seq``'s last ``n`` tokens: the longest ``n`` in [min_n, max_n] first, and for each
    ``n`` the latest occurrence first."""
    size = len(seq)
    # a match ends where an earlier position holds the last token; check its n - 1 before
    ends = np.flatnonzero(seq[: size - 1] == seq[-1])
    out: list[list[int]] = []
    if ends.size == 0:
        return out
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        if cand.size == 0:
            continue
        ok = np.ones(cand.size, dtype=bool)
        for j in range(1, n):
            ok &= seq[cand - j] == seq[size - 1 - j]
        for end in cand[ok][::-1].tolist():
            cont = seq[end + 1 : end + 1 + k].tolist()
            if cont not in out:
                out.append(cont)
                if len(out) == width:
                    return out
    return out


@hookimpl
def radixd_drafters():
    return {"ngram": NgramDrafter, "standalone": DraftModel, "eagle3": Eagle3Drafter}
