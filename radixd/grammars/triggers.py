"""Free text until a trigger: finding trigger texts in the output, and ``grammar_after``.

``Triggers`` is an Aho-Corasick automaton over the triggers' bytes; its state is the longest
tail of the output that is a prefix of a trigger. For each state it is in, the whole
vocabulary is scanned once (vectorized over the token trie, as grammar masks are) into a
``FreeScan``: which tokens free text may take there, the state after each, and which
trigger a token completes. Free text costs one cached mask per automaton state and nothing
else: every token is allowed (EOS and special tokens included) but those below.

A token is matched by its text: its bytes, or a special token's text (``<|python_tag|>``,
``[TOOL_CALLS]``), so a trigger may be one special token or plain text over several tokens.

Straddling: a token that completes a trigger *before* its last byte (it would run past the
trigger) is masked out; the token that completes a trigger exactly at its end is allowed,
and what the trigger opens starts with the next token. So the grammar behind a trigger
always starts at a token boundary and takes whole tokens, whatever backend compiled it.

``AfterText`` is ``grammar_after``: a compiled grammar of any kind and backend that applies
only from the first occurrence of a marker text in the output on (before it, free text).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from radixd.core.constraints import ClosesWithin, Forks
from radixd.grammars.vocab import TokenizerInfo


class FreeScan(NamedTuple):
    allowed: np.ndarray  # bool [V]: the tokens free text may take in this state
    nxt: np.ndarray      # int32 [V]: the state after each token that completes no trigger
    hit: np.ndarray      # int32 [V]: the trigger a token completes exactly at its end, else -1


class Triggers:
    """The automaton over ``triggers`` (none may contain another) for one vocabulary.
    ``scan(state)`` is computed once per state: at construction (in a compile worker) state 0
    (no trigger begun), then the others, shallowest first, within ``warm_budget_s`` of CPU
    time; the rest when first reached. Read-only once built, but for its scan cache."""

    def __init__(self, triggers: list[bytes], vocab: TokenizerInfo, warm_budget_s: float = 0.1):
        for i, a in enumerate(triggers):
            if not a:
                raise ValueError("a trigger must not be empty")
            for j, b in enumerate(triggers):
                if i != j and a in b:
                    raise ValueError(f"trigger {a.decode(errors='replace')!r} is part of trigger "
                                     f"{b.decode(errors='replace')!r}")
        self.triggers = triggers
        self.vocab = vocab
        goto: list[dict[int, int]] = [{}]
        term = [-1]
        for i, t in enumerate(triggers):
            s = 0
            for c in t:
                if c not in goto[s]:
                    goto.append({})
                    term.append(-1)
                    goto[s][c] = len(goto) - 1
                s = goto[s][c]
            term[s] = i
        delta = np.zeros((len(goto), 256), dtype=np.int32)
        fail = [0] * len(goto)
        order = [0]
        for s in order:  # breadth first: a state's fail link is shallower than the state
            if s:
                delta[s] = delta[fail[s]]
            for c, nxt in goto[s].items():
                fail[nxt] = int(delta[fail[s], c]) if s else 0
                delta[s, c] = nxt
                order.append(nxt)
        self.delta = delta
        self.term = np.array(term, dtype=np.int32)  # (no fail chain reaches a trigger's end:
        self._scans: dict[int, FreeScan] = {}     # no trigger contains another)
        deadline = time.thread_time() + warm_budget_s
        for q in order:  # (breadth first)
            if q and time.thread_time() > deadline:
                break
            self.scan(q)

    def scan(self, state: int) -> FreeScan:
        got = self._scans.get(state)
        if got is None:
            got = self._scans[state] = self._scan(state)
        return got

    def _scan(self, q: int) -> FreeScan:
        v, tr, delta, term = self.vocab, self.vocab.trie, self.delta, self.term
        st = np.empty(tr.size, dtype=np.int32)
        hit_at = np.full(tr.size, -1, dtype=np.int64)  # depth where the first trigger ended
        hit_t = np.full(tr.size, -1, dtype=np.int32)
        st[0] = q
        for d in range(1, len(tr.levels) - 1):  # the trie level by level
            lo, hi = tr.levels[d], tr.levels[d + 1]
            par = tr.parent[lo:hi]
            ns = delta[st[par], tr.byte[lo:hi]]
            st[lo:hi] = ns
            before = hit_at[par] >= 0
            now = ~before & (term[ns] >= 0)
            hit_at[lo:hi] = np.where(before, hit_at[par], np.where(now, d, -1))
            hit_t[lo:hi] = np.where(before, hit_t[par], term[ns])
        end = tr.end
        at = np.where(v.has_bytes, hit_at[end], -1)
        allowed = (at < 0) | (at == v.lengths)
        hit = np.where(v.has_bytes & (at >= 0), hit_t[end], -1).astype(np.int32)
        nxt = np.where(v.has_bytes, st[end], q).astype(np.int32)
        for tid, text in v.special.items():
            s, h = q, -1
            for i, c in enumerate(text):
                s = int(delta[s, c])
                if term[s] >= 0:
                    h = i + 1
                    break
            allowed[tid] = h < 0 or h == len(text)
            hit[tid] = term[s] if h >= 0 else -1
            nxt[tid] = s
        for e in v.eos_ids:  # the end of the text: allowed wherever free text is
            allowed[e], hit[e] = True, -1
        return FreeScan(allowed, nxt, hit)


class AfterText:
    """A compiled grammar (``inner``, any kind, any backend) that applies from the first
    occurrence of ``marker`` in the output on; ``matcher()`` as the backend contract."""

    def __init__(self, inner, marker: str, vocab: TokenizerInfo, warm_budget_s: float = 0.1):
        self.inner = inner
        self.triggers = Triggers([marker.encode()], vocab, warm_budget_s)
        self._cls: type[AfterTextMatcher] | None = None

    def matcher(self) -> AfterTextMatcher:
        m = self.inner.matcher()
        if self._cls is None:  # decided once: whether the inner matchers close within a budget
            self._cls = AfterTextClosing if isinstance(m, ClosesWithin) else AfterTextMatcher
        return self._cls(self.triggers, m)


class AfterTextMatcher:
    """Free text (``Triggers`` state ``state``) until the marker, then ``inner``'s grammar."""

    __slots__ = ("triggers", "inner", "state", "after")

    def __init__(self, triggers: Triggers, inner):
        self.triggers = triggers
        self.inner = inner
        self.state = 0
        self.after = False

    def fill_mask(self, out: np.ndarray) -> None:
        if self.after:
            self.inner.fill_mask(out)
        else:
            out[:] = self.triggers.scan(self.state).allowed

    def accept_token(self, token: int) -> bool:
        if self.after:
            return self.inner.accept_token(token)
        sc = self.triggers.scan(self.state)
        if not sc.allowed[token]:
            return False
        if sc.hit[token] >= 0:
            self.after = True
        else:
            self.state = int(sc.nxt[token])
        return True

    def is_terminated(self) -> bool:
        return self.after and self.inner.is_terminated()

    def fork(self) -> AfterTextMatcher | None:
        """A copy at the same position (``Forks``), if the inner matcher forks too."""
        inner = self.inner.fork() if isinstance(self.inner, Forks) else None
        if inner is None:
            return None
        m = type(self)(self.triggers, inner)
        m.state, m.after = self.state, self.after
        return m


class AfterTextClosing(AfterTextMatcher):
    """An ``AfterTextMatcher`` whose inner matcher closes within a token budget (it has
    ``fill_mask_within``); before the marker nothing is held back."""

    __slots__ = ()

    def fill_mask_within(self, out: np.ndarray, tokens_left: int) -> None:
        if self.after:
            self.inner.fill_mask_within(out, tokens_left)
        else:
            self.fill_mask(out)
