"""Lexers and the vocabulary walks through them, for one vocabulary and any grammar.

A ``Lexer`` is the byte DFA of one set of terminals (the terminals a parser state may take
next, with or without the ignored ones); ``SharedLexers`` keeps them and their scans for every
grammar compiled for one vocabulary, keyed by the terminals' regexes. The walks here are
stack-independent: they say where each token's bytes go inside a lexer DFA (which tokens stay
inside the lexeme, where the others leave it, from which accepting state), and the grammar
(``automaton``) continues the leaving ones from the parser configuration after that lexeme.

Contract: compile workers (``TokenGrammar.warm``) and the event loop both fill the caches;
``SharedLexers.dfa`` builds under a lock, scans are written without one (a scan is a function
of its key alone, so one built twice is built alike). Each cache is bounded and emptied when
full (``caches.remember``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixd.grammars.caches import remember
from radixd.grammars.regex_dfa import DFA, compile_dfa
from radixd.grammars.vocab import TokenizerInfo, expand_ranges

SMALL_WALK = 32  # trie walks from at most this many nodes run in plain Python


@dataclass
class Terminal:
    name: str
    regex: str
    priority: int = 0
    literal: bool = False   # string terminals win ties against regex ones (as in Lark)


class StateScan(NamedTuple):
    """The whole vocabulary walked through one lexer DFA from one state (stack-independent)."""

    inside: np.ndarray        # tokens whose bytes all stay inside the lexeme: bool [vocab]
                              # when many (a string's inside), else their ids
    exit0: np.ndarray | None  # bool [vocab]: tokens whose first byte ends the lexeme here
                              # (None: the state is not accepting)
    groups: list              # (s, trie nodes): tokens below the nodes leave the lexeme
                              # there, from accepting state s, after one byte or more

    def allowed(self, vocab_size: int) -> np.ndarray:
        """``inside`` as a new bool [vocab] array."""
        if self.inside.dtype == bool:
            return self.inside.copy()
        ok = np.zeros(vocab_size, dtype=bool)
        ok[self.inside] = True
        return ok


def tokens_ending_at(tr, alive_at: list[np.ndarray], dtype) -> np.ndarray:
    """The token ids whose bytes end exactly at one of the trie nodes ``alive_at``."""
    if not alive_at:
        return np.zeros(0, dtype=dtype)
    ends = np.concatenate(alive_at)
    ends = ends[tr.exact[ends] > 0]
    return tr.order[expand_ranges(tr.lo[ends], tr.exact[ends])].astype(dtype, copy=False)


def leave_groups(left_at: list[np.ndarray], left_from: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
    """Trie nodes where walks left a lexeme, grouped by the DFA state they left from."""
    if not left_at:
        return []
    where, prev = np.concatenate(left_at), np.concatenate(left_from)
    return [(s, where[prev == s]) for s in np.unique(prev).tolist()]


class SharedLexers:
    """Lexer DFAs and their vocabulary scans, shared by every grammar compiled for one
    vocabulary: keyed by the terminals' regexes, so the string, number and punctuation lexers
    of many JSON Schemas are built and scanned once. Bounded (``limit`` lexers, ``scan_limit``
    scans of each kind, mostly sparse: a few KB each); a cache is cleared when full."""

    def __init__(self, limit: int = 2048, scan_limit: int = 32768):
        self.limit = limit
        self.scan_limit = scan_limit
        self.dfas: dict[tuple[str, ...], tuple[int, DFA, list, np.ndarray, np.ndarray]] = {}
        self.scans: dict[tuple, tuple] = {}    # (lexer, trie nodes) -> where the walks go
        self.tries: dict[tuple, StateScan] = {}  # (lexer, DFA state) -> the vocabulary's walk
        self.exits: dict[bytes, np.ndarray] = {}  # bytes ending a lexeme -> tokens starting so
        self._uids = itertools.count()
        self._lock = threading.Lock()  # compile workers and the event loop both build lexers

    def dfa(self, regexes: tuple[str, ...]):
        got = self.dfas.get(regexes)
        if got is not None:
            return got
        with self._lock:
            got = self.dfas.get(regexes)
            if got is None:
                dfa = compile_dfa(list(regexes))
                accepting = np.array([bool(a) for a in dfa.accepts], dtype=bool)
                # a uid is never reused: scans are cached under it
                got = (next(self._uids), dfa, dfa.table.tolist(), dfa.table.astype(np.int64).ravel(), accepting)
                remember(self.dfas, regexes, got, self.limit)
        return got

    def remember(self, cache: dict, key, value) -> None:
        remember(cache, key, value, self.scan_limit)


class Lexer:
    """The DFA recognizing one set of terminals; ``choice[state]``: the terminal a lexeme
    ending in ``state`` is taken as (preferred first)."""

    def __init__(self, shared: SharedLexers, terms: tuple[int, ...], terminals: list[Terminal]):
        self.uid, self.dfa, self.rows, self.flat, self.accepting = shared.dfa(tuple(terminals[t].regex for t in terms))
        self.table = self.dfa.table
        order = {t: (-terminals[t].priority, not terminals[t].literal, t) for t in terms}
        self.choice = [tuple(sorted((terms[i] for i in acc), key=order.__getitem__)) for acc in self.dfa.accepts]


def node_walk(vocab: TokenizerInfo, lx: Lexer, nodes: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, list]:
    """Walk the trie below ``nodes`` through the lexer DFA, entering each node from
    ``states`` (its parent's state), frontier by frontier over the live nodes only (shared
    prefixes are walked once). Returns (token ids that end inside the lexeme, groups:
    (s, nodes where walks leave the lexeme from accepting state s, deeper than the
    starting nodes: a lexeme is never empty))."""
    if nodes.size <= SMALL_WALK:
        return node_walk_small(vocab, lx, nodes.tolist(), states.tolist())
    return node_walk_vectorized(vocab, lx, nodes, states)


def lexeme_walk(shared: SharedLexers, vocab: TokenizerInfo, lx: Lexer, key: tuple,
                nodes: np.ndarray) -> tuple[np.ndarray, list]:
    """``node_walk`` of the trie below ``nodes`` through ``lx`` from its start state (the bytes
    from each node on begin a new lexeme), cached in ``shared.scans`` under ``key``, which
    names the nodes (the walks that left there)."""
    ck = (lx.uid, key)
    got = shared.scans.get(ck)
    if got is None:
        got = node_walk(vocab, lx, nodes, np.ones(nodes.size, dtype=np.int64))
        shared.remember(shared.scans, ck, got)
    return got


def node_walk_vectorized(vocab: TokenizerInfo, lx: Lexer, nodes: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, list]:
    """``node_walk`` frontier by frontier, with numpy gathers (however few the nodes)."""
    tr = vocab.trie
    flat, accepting = lx.flat, lx.accepting
    alive_at: list[np.ndarray] = []
    left_at: list[np.ndarray] = []
    left_from: list[np.ndarray] = []
    first = True
    while nodes.size:
        ns = flat[states * 256 + tr.byte[nodes]]
        live = ns != 0
        if not first:
            leave = accepting[states] & ~live
            if leave.any():
                left_at.append(nodes[leave])
                left_from.append(states[leave])
        first = False
        nodes = nodes[live]
        if not nodes.size:
            break
        alive_at.append(nodes)
        counts = tr.child_count[nodes]
        states = np.repeat(ns[live], counts)
        nodes = expand_ranges(tr.child_start[nodes], counts)
    return tokens_ending_at(tr, alive_at, np.int64), leave_groups(left_at, left_from)


def node_walk_small(vocab: TokenizerInfo, lx: Lexer, nodes: list[int], states: list[int]) -> tuple[np.ndarray, list]:
    """``node_walk`` depth first in plain Python, for a few starting nodes; a live node's
    children are still tested together (one gather) when there are many."""
    t = vocab.trie.lists
    flat, rows, accepting = lx.flat, lx.rows, lx.accepting
    inside: list[int] = []
    left: dict[int, list[int]] = {}
    todo = [(n, s, True) for n, s in zip(nodes, states, strict=True)]
    while todo:
        n, ps, first = todo.pop()
        ns = rows[ps][t.byte[n]]
        if not ns:
            if not first and accepting[ps]:
                left.setdefault(ps, []).append(n)
            continue
        if t.exact[n]:
            lo = t.lo[n]
            inside.extend(t.order[lo:lo + t.exact[n]])
        a, k = t.child_start[n], t.child_count[n]
        if k <= 16:
            todo.extend((c, ns, False) for c in range(a, a + k))
            continue
        nxt = flat[ns * 256 + vocab.trie.byte[a:a + k]]
        live = np.flatnonzero(nxt)
        todo.extend((c, ns, False) for c in (live + a).tolist())
        if accepting[ns] and live.size < k:
            dead = np.flatnonzero(nxt == 0) + a
            left.setdefault(ns, []).extend(dead.tolist())
    groups = [(s, np.array(ns_, dtype=np.int64)) for s, ns_ in sorted(left.items())]
    return np.array(inside, dtype=np.int64), groups


def state_scan(shared: SharedLexers, vocab: TokenizerInfo, lx: Lexer, q: int) -> StateScan:
    """The whole vocabulary walked from DFA state ``q`` through the token trie, level by
    level: one gather over a level when most of it is live (a string's inside), else
    over the children of its live nodes only. Cached per (lexer, state) and shared by
    every grammar using the lexer."""
    key = (lx.uid, q)
    got = shared.tries.get(key)
    if got is not None:
        return got
    v = vocab
    tr = v.trie
    flat, accepting = lx.flat, lx.accepting
    state = np.zeros(tr.size, dtype=np.int64)
    state[0] = q
    lv = tr.levels
    n_alive = 0
    alive_at: list[np.ndarray] = []
    left_at: list[np.ndarray] = []    # nodes where walks leave the lexeme (depth >= 2)
    left_from: list[np.ndarray] = []  # ... from that accepting state
    alive = np.zeros(1, dtype=np.int64)  # live nodes of the level above
    for d in range(1, len(lv) - 1):
        a, b = lv[d], lv[d + 1]
        if alive.size * 8 > b - a:
            idx = None
            ps = state[tr.parent[a:b]]
            ns = flat[ps * 256 + tr.byte[a:b]]
            state[a:b] = ns
            alive = np.flatnonzero(ns) + a
        else:
            idx = expand_ranges(tr.child_start[alive], tr.child_count[alive])
            if not idx.size:
                break
            ps = state[tr.parent[idx]]
            ns = flat[ps * 256 + tr.byte[idx]]
            state[idx] = ns
            alive = idx[ns != 0]
        if d > 1:  # (tokens whose first byte already leaves: ``exit0``)
            leave = accepting[ps] & (ns == 0)
            if leave.any():
                where = np.flatnonzero(leave)
                left_at.append(where + a if idx is None else idx[where])
                left_from.append(ps[where])
        if not alive.size:
            break  # every deeper node is dead (state 0 already)
        alive_at.append(alive)
        n_alive += alive.size
    if n_alive * 4 > v.vocab_size:  # a dense walk: one gather over every token's end
        inside = (state[tr.end] != 0) & v.has_bytes
    else:
        inside = tokens_ending_at(tr, alive_at, np.int32)
    groups = leave_groups(left_at, left_from)
    exit0 = None
    if accepting[q]:
        ends = lx.table[q] == 0
        exit0 = shared.exits.get(ends.tobytes())
        if exit0 is None:  # (few distinct: most accepting states end on every byte)
            exit0 = ends[v.first_byte] & v.has_bytes
            shared.remember(shared.exits, ends.tobytes(), exit0)
    got = StateScan(inside, exit0, groups)
    shared.remember(shared.tries, key, got)
    return got
