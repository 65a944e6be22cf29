"""Token masks from a lexer + LALR parser over bytes.

A grammar is a list of terminals (regexes, compiled to byte DFAs) and a parser over them:
an LALR table from Lark for grammars, a one-terminal parser for a plain regex. Matching state
is an immutable *configuration*::

    (stack, ignore_ok, lex)   stack: parser state stack (a tuple)
                              ignore_ok: an ignored terminal (bounded JSON whitespace) may
                                         start here (never two in a row)
                              lex: DFA state inside the current lexeme, or FRESH

Lexing is by longest match, as Lark's contextual lexer does: the lexer in a configuration
recognizes the terminals the parser can take next (plus the ignored ones); a lexeme ends when
the next byte cannot extend it, and is then fed to the parser, so one vocabulary token may
cross several terminal boundaries.

The mask of a configuration is computed once, vectorized over the whole vocabulary: every
token's bytes are walked through the lexer DFA together (numpy gathers); tokens that leave the
lexeme in an accepting state continue, again together, from the configuration after that
terminal. Masks and token transitions are cached per configuration.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixd.grammars.regex_dfa import DFA, compile_dfa
from radixd.grammars.vocab import TokenizerInfo, expand_ranges

FRESH = -1
Config = tuple  # (stack, ignore_ok, lex)


# ---------------------------------------------------------------------------------------------
# Parsers (over terminal indices)
# ---------------------------------------------------------------------------------------------


class SingleTerminalParser:
    """The whole text is terminal 0 (a regex constraint)."""

    start = (0,)

    def feed(self, stack: tuple, term: int) -> tuple | None:
        return (1,) if stack == (0,) and term == 0 else None

    def candidates(self, stack: tuple) -> tuple[int, ...]:
        return (0,) if stack == (0,) else ()

    def accepts_end(self, stack: tuple) -> bool:
        return stack == (1,)


class LalrParser:
    """Drives a Lark LALR(1) table; stacks are tuples of parser states."""

    def __init__(self, parse_table, term_ids: dict[str, int], end_id: int, start: str = "start"):
        self.actions: dict[int, dict[int, tuple]] = {}
        self.goto: dict[int, dict[str, int]] = {}
        for state, row in parse_table.states.items():
            acts, gotos = {}, {}
            for sym, (action, arg) in row.items():
                is_shift = action.name == "Shift"
                if sym == "$END":
                    acts[end_id] = (True, arg) if is_shift else (False, arg.origin.name, len(arg.expansion))
                elif sym in term_ids:
                    acts[term_ids[sym]] = (True, arg) if is_shift else (False, arg.origin.name, len(arg.expansion))
                else:
                    gotos[sym] = arg
            self.actions[state] = acts
            self.goto[state] = gotos
        self.start = (parse_table.start_states[start],)
        self.end_state = parse_table.end_states[start]
        self.end_id = end_id
        self._cands: dict[int, tuple[int, ...]] = {}

    def feed(self, stack: tuple, term: int) -> tuple | None:
        while True:
            act = self.actions[stack[-1]].get(term)
            if act is None:
                return None
            if act[0]:
                return stack + (act[1],)
            n = act[2]
            if n:
                stack = stack[:-n]
            stack = stack + (self.goto[stack[-1]][act[1]],)
            if term == self.end_id and stack[-1] == self.end_state:
                return stack

    def candidates(self, stack: tuple) -> tuple[int, ...]:
        top = stack[-1]
        c = self._cands.get(top)
        if c is None:
            c = self._cands[top] = tuple(t for t in self.actions[top] if t != self.end_id)
        return c

    def accepts_end(self, stack: tuple) -> bool:
        return self.feed(stack, self.end_id) is not None


# ---------------------------------------------------------------------------------------------
# The compiled grammar
# ---------------------------------------------------------------------------------------------


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


def remember(cache: dict, key, value, limit: int):
    """``cache[key] = value``, emptying the cache first when it holds ``limit`` entries (the
    grammar caches are bounded this way: refilling is cheap, tracking recency is not)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


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
                if len(self.dfas) >= self.limit:
                    self.dfas.clear()
                self.dfas[regexes] = got
        return got

    def remember(self, cache: dict, key, value) -> None:
        remember(cache, key, value, self.scan_limit)


class _Lexer:
    """The DFA recognizing one set of terminals; ``choice[state]``: the terminal a lexeme
    ending in ``state`` is taken as (preferred first)."""

    def __init__(self, shared: SharedLexers, terms: tuple[int, ...], terminals: list[Terminal]):
        self.uid, self.dfa, self.rows, self.flat, self.accepting = shared.dfa(tuple(terminals[t].regex for t in terms))
        self.table = self.dfa.table
        order = {t: (-terminals[t].priority, not terminals[t].literal, t) for t in terms}
        self.choice = [tuple(sorted((terms[i] for i in acc), key=order.__getitem__)) for acc in self.dfa.accepts]


class _Follow:
    """For warming up: the lexers that may come after a lexeme, from the parse table alone
    (a terminal's shift targets; after an ignored terminal, the same parser state without
    the ignored ones). A superset of what a parser stack allows (LALR lookaheads)."""

    def __init__(self, g: TokenGrammar, actions: dict):
        self.ignore = g.ignore
        self.after: dict[int, dict[int, _Lexer]] = {}
        for acts in actions.values():
            for t, act in acts.items():
                if act[0]:  # shift to state act[1]
                    cands = frozenset(g.parser.candidates((act[1],)))
                    lx = g._lexers.get(cands | g.ignore) if cands else None
                    if lx is not None:
                        self.after.setdefault(t, {})[lx.uid] = lx
        self.plain = {lx.uid: g._lexers.get(terms - g.ignore) for terms, lx in g._lexers.items()}

    def lexers(self, lx: _Lexer, s: int) -> list[_Lexer]:
        out: dict[int, _Lexer] = {}
        for t in lx.choice[s]:
            if t in self.ignore:
                nxt = self.plain.get(lx.uid)
                if nxt is not None:
                    out[nxt.uid] = nxt
            else:
                out.update(self.after.get(t, {}))
        return list(out.values())


class TokenGrammar:
    """A grammar compiled for one vocabulary. Thread-compatible for reads of cached masks;
    the engine uses it from one thread."""

    small_walk = 32  # trie walks from at most this many nodes run in plain Python

    def __init__(self, terminals: list[Terminal], parser, vocab: TokenizerInfo, ignore: frozenset[int] = frozenset(),
                 mask_cache_size: int = 1024, shared: SharedLexers | None = None):
        self.terminals = terminals
        self.parser = parser
        self.vocab = vocab
        self.ignore = ignore
        self.start: Config = (parser.start, True, FRESH)
        self._lexers: dict[frozenset[int], _Lexer] = {}
        self._lexer_of: dict[tuple, _Lexer] = {}
        self._acceptable: dict[tuple, frozenset[int]] = {}
        self._ends: dict[tuple, tuple | None] = {}
        self._masks: OrderedDict[Config, tuple[np.ndarray, bool]] = OrderedDict()
        self._mask_cache_size = mask_cache_size
        self._steps: dict[tuple, Config | None] = {}
        self._fresh: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._fresh_cache_size = max(64, mask_cache_size // 4)
        self.shared = shared if shared is not None else SharedLexers()
        self._scans = self.shared.scans
        self._tries = self.shared.tries
        self.eos = np.array(vocab.eos_ids, dtype=np.int64)
        self._eos_set = frozenset(vocab.eos_ids)

    # -------------------------------------------------------------- lexers

    def acceptable(self, stack: tuple) -> frozenset[int]:
        """Terminals the parser really takes next (LALR rows may name terminals that fail
        after reductions)."""
        got = self._acceptable.get(stack)
        if got is None:
            got = frozenset(t for t in self.parser.candidates(stack) if self.parser.feed(stack, t) is not None)
            self._acceptable[stack] = got
        return got

    def lexer(self, stack: tuple, ignore_ok: bool) -> _Lexer:
        key = (stack, ignore_ok)
        lx = self._lexer_of.get(key)
        if lx is None:
            terms = self.acceptable(stack) | (self.ignore if ignore_ok else frozenset())
            lx = self._lexers.get(terms)
            if lx is None:
                lx = self._lexers[terms] = _Lexer(self.shared, tuple(sorted(terms)), self.terminals)
            remember(self._lexer_of, key, lx, 65536)
        return lx

    def warm(self, budget_s: float = 0.1) -> None:
        """Part of compiling (off the event loop): build the lexer of every parser state's
        terminals (with and without the ignored ones), then scan the vocabulary from their
        DFA states, nearest the start first, and walk the tokens that leave a lexeme on
        through the lexers that may come next, then make the vocabulary walks at the lexeme
        starts the parser reaches first, until ``budget_s`` seconds of this thread's CPU
        time have passed (so a busy machine does the same work, only slower). First masks
        then mostly find their scans ready; scans already made for another grammar are
        shared and cost nothing here."""
        deadline = time.thread_time() + budget_s
        lexers = [self.lexer(self.start[0], True)]
        actions = getattr(self.parser, "actions", {})
        for top in actions:
            cands = frozenset(self.parser.candidates((top,)))
            if not cands:
                continue
            for terms in (cands | self.ignore, cands):
                lx = self._lexers.get(terms)
                if lx is None:
                    lx = self._lexers[terms] = _Lexer(self.shared, tuple(sorted(terms)), self.terminals)
                    lexers.append(lx)
        follow = _Follow(self, actions)
        frontier = [(lx, 1) for lx in lexers]
        seen = {(lx.uid, 1) for lx in lexers}
        while frontier:  # breadth first over every lexer's DFA at once (every start state)
            after = []
            for lx, q in frontier:
                if q != 1 and time.thread_time() > deadline:
                    return
                sc = self._state_scan(lx, q)
                self._warm_continue(lx, (lx.uid, q), sc.groups, follow, 2, deadline)
                for t in set(lx.rows[q]):
                    if t and (lx.uid, t) not in seen:
                        seen.add((lx.uid, t))
                        after.append((lx, t))
            frontier = after
        self._warm_fresh(deadline)

    def _warm_fresh(self, deadline: float) -> None:
        """The vocabulary walks at lexeme starts (``_fresh_walk``) of the (stack, ignore_ok)
        pairs the parser reaches first, breadth first from the start, up to a quarter of their
        cache."""
        todo = [(self.start[0], True)]
        seen = set(todo)
        for after in todo:  # (grows while read)
            if len(self._fresh) * 4 >= self._fresh_cache_size or time.thread_time() > deadline:
                return
            self._fresh_walk(after)
            stack, ign = after
            for t in self.acceptable(stack) | (self.ignore if ign else frozenset()):
                if t in self.ignore:
                    nxt = (stack, False)
                else:
                    ns = self.parser.feed(stack, t)
                    nxt = None if ns is None else (ns, True)
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)

    def _warm_continue(self, lx: _Lexer, prefix: tuple, groups: list, follow: _Follow, depth: int,
                       deadline: float) -> None:
        """The ``_continue`` scans of ``groups`` (left from ``lx``; their keys ``prefix + (s,)``)
        through each lexer that may follow, ``depth`` lexemes on."""
        for s, nodes in groups:
            key = prefix + (s,)
            for nxt in follow.lexers(lx, s):
                if time.thread_time() > deadline:
                    return
                ck = (nxt.uid, key)
                got = self._scans.get(ck)
                if got is None:
                    got = self._node_walk(nxt, nodes, np.ones(nodes.size, dtype=np.int64))
                    self.shared.remember(self._scans, ck, got)
                if depth > 1 and got[1]:
                    self._warm_continue(nxt, (key, nxt.uid), got[1], follow, depth - 1, deadline)

    # -------------------------------------------------------------- stepping

    def end_lexeme(self, stack: tuple, ignore_ok: bool, lex: int) -> tuple | None:
        """(stack, ignore_ok) after the lexeme that reached DFA state ``lex`` ends, or None."""
        key = (stack, ignore_ok, lex)
        if key in self._ends:
            return self._ends[key]
        out = None
        for t in self.lexer(stack, ignore_ok).choice[lex]:
            if t in self.ignore:
                out = (stack, False)
                break
            ns = self.parser.feed(stack, t)
            if ns is not None:
                out = (ns, True)
                break
        return remember(self._ends, key, out, 65536)

    def advance(self, config: Config, data: bytes) -> Config | None:
        stack, ign, lex = config
        lx = self.lexer(stack, ign)
        i, n = 0, len(data)
        while i < n:
            nxt = lx.rows[1 if lex == FRESH else lex][data[i]]
            if nxt:
                lex = nxt
                i += 1
                continue
            if lex == FRESH:
                return None
            r = self.end_lexeme(stack, ign, lex)
            if r is None:
                return None
            stack, ign = r
            lex = FRESH
            lx = self.lexer(stack, ign)
        return (stack, ign, lex)

    def step(self, config: Config, token: int) -> Config | None:
        key = (config, token)
        got = self._steps.get(key, False)
        if got is False:
            data = self.vocab.token_bytes[token]
            got = remember(self._steps, key, self.advance(config, data) if data else None, 262144)
        return got

    def end_ok(self, config: Config) -> bool:
        """May the text end here (EOS allowed)?"""
        stack, ign, lex = config
        if lex == FRESH:
            if self.parser.accepts_end(stack):
                return True
            lex = 1  # a terminal matching the empty string (a regex like ``a*``)
        r = self.end_lexeme(stack, ign, lex)
        return r is not None and self.parser.accepts_end(r[0])

    def finished(self, config: Config) -> bool:
        """The text is complete and nothing but ignored terminals could follow."""
        stack, ign, lex = config
        if lex != FRESH:
            if self.lexer(stack, ign).dfa.live[lex]:
                return False
            r = self.end_lexeme(stack, ign, lex)
            if r is None:
                return False
            stack = r[0]
        return self.parser.accepts_end(stack) and not self.acceptable(stack)

    # -------------------------------------------------------------- masks

    def mask(self, config: Config) -> tuple[np.ndarray, bool]:
        """(allowed [vocab_size] bool, terminated): terminated = only EOS may follow."""
        got = self._masks.get(config)
        if got is not None:
            self._masks.move_to_end(config)
            return got
        stack, ign, lex = config
        terminated = self.finished(config)
        if terminated:  # (trailing ignored terminals are not offered)
            allowed = np.zeros(self.vocab.vocab_size, dtype=bool)
        else:
            allowed = self._fresh_walk((stack, ign)).copy() if lex == FRESH else self._vocab_walk(stack, ign, lex)
            terminated = not allowed.any()
        if self.eos.size and (terminated or self.end_ok(config)):
            allowed[self.eos] = True  # a dead end (never expected) finishes rather than rambles
        got = (allowed, terminated)
        self._masks[config] = got
        if len(self._masks) > self._mask_cache_size:
            self._masks.popitem(last=False)
        return got

    def _vocab_walk(self, stack: tuple, ign: bool, lex: int) -> np.ndarray:
        """Which tokens of the whole vocabulary can be consumed from the configuration (a new
        array). The lexer's scan from ``lex`` says which tokens stay inside the lexeme, which
        end it before their first byte (they continue whole from the configuration after the
        lexeme: its own vocabulary walk, cached) and which leave it later (the trie below
        the nodes where they leave is walked on from the configuration after the lexeme)."""
        lx = self.lexer(stack, ign)
        q = 1 if lex == FRESH else lex
        sc = self._state_scan(lx, q)
        ok = sc.allowed(self.vocab.vocab_size)
        if lex != FRESH and sc.exit0 is not None:  # (a lexeme is never empty)
            r = self.end_lexeme(stack, ign, q)
            if r is not None:
                ok |= sc.exit0 & self._fresh_walk(r)
        for s, nodes in sc.groups:
            r = self.end_lexeme(stack, ign, s)
            if r is not None:
                ok[self._continue(r, nodes, (lx.uid, q, s))] = True
        return ok

    def _fresh_walk(self, after: tuple) -> np.ndarray:
        """``_vocab_walk`` at the start of a lexeme (read-only, cached per (stack, ignore_ok))."""
        got = self._fresh.get(after)
        if got is None:
            got = self._fresh[after] = self._vocab_walk(after[0], after[1], FRESH)
            if len(self._fresh) > self._fresh_cache_size:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(after)
        return got

    def _continue(self, after: tuple, nodes: np.ndarray, key: tuple) -> np.ndarray:
        """Token ids below trie ``nodes`` that can be consumed from the start of a lexeme in
        (stack, ignore_ok) ``after``, reading from each node's byte on. ``key`` names the
        nodes (the scans that left there), for the stack-independent scan cache."""
        stack, ign = after
        lx = self.lexer(stack, ign)
        ck = (lx.uid, key)
        got = self._scans.get(ck)
        if got is None:
            got = self._node_walk(lx, nodes, np.ones(nodes.size, dtype=np.int64))
            self.shared.remember(self._scans, ck, got)
        inside, groups = got
        if not groups:
            return inside
        parts = [inside]
        for s, sub in groups:
            r = self.end_lexeme(stack, ign, s)
            if r is not None:
                parts.append(self._continue(r, sub, (key, lx.uid, s)))
        return np.concatenate(parts)

    def _node_walk(self, lx: _Lexer, nodes: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, list]:
        """Walk the trie below ``nodes`` through the lexer DFA, entering each node from
        ``states`` (its parent's state), frontier by frontier over the live nodes only (shared
        prefixes are walked once). Returns (token ids that end inside the lexeme, groups:
        (s, nodes where walks leave the lexeme from accepting state s, deeper than the
        starting nodes: a lexeme is never empty))."""
        if nodes.size <= self.small_walk:
            return self._node_walk_small(lx, nodes.tolist(), states.tolist())
        tr = self.vocab.trie
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

    def _node_walk_small(self, lx: _Lexer, nodes: list[int], states: list[int]) -> tuple[np.ndarray, list]:
        """``_node_walk`` depth first in plain Python, for a few starting nodes; a live node's
        children are still tested together (one gather) when there are many."""
        t = self.vocab.trie.lists
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
            nxt = flat[ns * 256 + self.vocab.trie.byte[a:a + k]]
            live = np.flatnonzero(nxt)
            todo.extend((c, ns, False) for c in (live + a).tolist())
            if accepting[ns] and live.size < k:
                dead = np.flatnonzero(nxt == 0) + a
                left.setdefault(ns, []).extend(dead.tolist())
        groups = [(s, np.array(ns_, dtype=np.int64)) for s, ns_ in sorted(left.items())]
        return np.array(inside, dtype=np.int64), groups

    def _state_scan(self, lx: _Lexer, q: int) -> StateScan:
        """The whole vocabulary walked from DFA state ``q`` through the token trie, level by
        level: one gather over a level when most of it is live (a string's inside), else
        over the children of its live nodes only. Cached per (lexer, state) and shared by
        every grammar using the lexer."""
        key = (lx.uid, q)
        got = self._tries.get(key)
        if got is not None:
            return got
        v = self.vocab
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
            exit0 = self.shared.exits.get(ends.tobytes())
            if exit0 is None:  # (few distinct: most accepting states end on every byte)
                exit0 = ends[v.first_byte] & v.has_bytes
                self.shared.remember(self.shared.exits, ends.tobytes(), exit0)
        got = StateScan(inside, exit0, groups)
        self.shared.remember(self._tries, key, got)
        return got


class Matcher:
    """One sequence's position in a grammar: ``accept_token``, ``fill_mask``, ``is_terminated``."""

    __slots__ = ("grammar", "config", "done")

    def __init__(self, grammar: TokenGrammar):
        self.grammar = grammar
        self.config: Config = grammar.start
        self.done = False

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) if the grammar does not allow it."""
        g = self.grammar
        if self.done:
            return False
        if token in g._eos_set:
            if g.end_ok(self.config):
                self.done = True
                return True
            return False
        nxt = g.step(self.config, token)
        if nxt is None:
            return False
        self.config = nxt
        return True

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed tokens (bool per vocabulary id) into ``out``."""
        if self.done:
            out[:] = False
            out[self.grammar.eos] = True
            return
        out[:] = self.grammar.mask(self.config)[0]

    def allowed(self) -> np.ndarray:
        """The cached mask itself (read-only by convention)."""
        return self.grammar.mask(self.config)[0]

    def is_terminated(self) -> bool:
        return self.done or self.grammar.mask(self.config)[1]
