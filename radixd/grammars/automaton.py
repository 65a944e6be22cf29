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


class SharedLexers:
    """Lexer DFAs and their vocabulary scans, shared by every grammar compiled for one
    vocabulary: keyed by the terminals' regexes, so the string, number and punctuation lexers
    of many JSON Schemas are built and scanned once. Bounded; cleared when full."""

    def __init__(self, limit: int = 2048):
        self.limit = limit
        self.dfas: dict[tuple[str, ...], tuple[int, DFA, list, np.ndarray, np.ndarray]] = {}
        self.scans: dict[tuple, tuple] = {}
        self.tries: dict[tuple, tuple] = {}
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
        if len(cache) >= self.limit:
            cache.clear()
        cache[key] = value


class StateScan(NamedTuple):
    """The whole vocabulary walked through one lexer DFA from one state (stack-independent)."""

    inside: np.ndarray        # bool [vocab]: tokens whose bytes all stay inside the lexeme
    exit0: np.ndarray | None  # bool [vocab]: tokens whose first byte ends the lexeme here
                              # (None: the state is not accepting)
    groups: list              # (s, token ids, bytes consumed): longer tokens leaving the
                              # lexeme from accepting state s after consuming some bytes


class _Lexer:
    """The DFA recognizing one set of terminals; ``choice[state]``: the terminal a lexeme
    ending in ``state`` is taken as (preferred first)."""

    def __init__(self, shared: SharedLexers, terms: tuple[int, ...], terminals: list[Terminal]):
        self.uid, self.dfa, self.rows, self.flat, self.accepting = shared.dfa(tuple(terminals[t].regex for t in terms))
        self.table = self.dfa.table
        order = {t: (-terminals[t].priority, not terminals[t].literal, t) for t in terms}
        self.choice = [tuple(sorted((terms[i] for i in acc), key=order.__getitem__)) for acc in self.dfa.accepts]


class TokenGrammar:
    """A grammar compiled for one vocabulary. Thread-compatible for reads of cached masks;
    the engine uses it from one thread."""

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
            if len(self._lexer_of) > 65536:
                self._lexer_of.clear()
            self._lexer_of[key] = lx
        return lx

    def warm(self) -> None:
        """Part of compiling (off the event loop): build the lexer of every parser state's
        terminals (with and without the ignored ones) and scan the vocabulary from each
        lexer's start, so first masks mostly find their DFAs and scans ready."""
        self.lexer(self.start[0], True)
        actions = getattr(self.parser, "actions", None)
        if actions is None:
            return
        for top in actions:
            cands = frozenset(self.parser.candidates((top,)))
            if not cands:
                continue
            for terms in (cands | self.ignore, cands):
                lx = self._lexers.get(terms)
                if lx is None:
                    lx = self._lexers[terms] = _Lexer(self.shared, tuple(sorted(terms)), self.terminals)
                    self._state_scan(lx, 1)

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
        if len(self._ends) > 65536:
            self._ends.clear()
        self._ends[key] = out
        return out

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
            got = self.advance(config, data) if data else None
            if len(self._steps) > 262144:
                self._steps.clear()
            self._steps[key] = got
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
            allowed = self._vocab_walk(stack, ign, lex)
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
        lexeme: its own vocabulary walk, cached) and which leave it later (their suffixes are
        walked from the next configuration, as a few rows)."""
        lx = self.lexer(stack, ign)
        q = 1 if lex == FRESH else lex
        sc = self._state_scan(lx, q)
        ok = sc.inside.copy()
        if lex != FRESH and sc.exit0 is not None:  # (a lexeme is never empty)
            r = self.end_lexeme(stack, ign, q)
            if r is not None:
                ok |= sc.exit0 & self._fresh_walk(r)
        for s, toks, offs in sc.groups:
            r = self.end_lexeme(stack, ign, s)
            if r is not None:
                ok[toks] = self._walk(r[0], r[1], FRESH, toks, offs, (lx.uid, q, s))
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

    def _walk(self, stack: tuple, ign: bool, lex: int, rows: np.ndarray, offs: np.ndarray, key: tuple) -> np.ndarray:
        """Which of the tokens ``rows`` (from byte ``offs`` on) can be consumed from the
        configuration; a bool per row. ``key`` names the row subset (for the scan cache)."""
        lx = self.lexer(stack, ign)
        start = 1 if lex == FRESH else lex
        inside, groups = self._scan(lx, start, key, rows, offs, lex == FRESH)
        ok = inside.copy()
        for s, p, noffs in groups:
            r = self.end_lexeme(stack, ign, s)
            if r is not None:
                ok[p] = self._walk(r[0], r[1], FRESH, rows[p], noffs, (key, lx.uid, start, s))
        return ok

    def _scan(self, lx: _Lexer, start: int, key: tuple, rows: np.ndarray, offs: np.ndarray, fresh: bool):
        """Walk the token suffixes through one lexer DFA from ``start``. Returns (ok: rows
        that end inside the lexeme, groups: per accepting state ``s`` where rows leave the
        lexeme, (s, their positions, the offsets they continue from)). Depends only on the
        lexer, so it is cached apart from the parser stack."""
        ck = (lx.uid, start, key)
        got = self._scans.get(ck)
        if got is not None:
            return got
        cpos, cprev, ck_, ok = self._row_scan(lx, start, fresh, rows, offs)
        groups = []
        if cpos.size:
            first = int(cprev[0])
            if (cprev == first).all():  # usually one state where tokens leave the lexeme
                groups.append((first, cpos, offs[cpos] + ck_))
            else:
                for s in np.unique(cprev):
                    sel = cprev == s
                    p = cpos[sel]
                    groups.append((int(s), p, offs[p] + ck_[sel]))
        got = (ok, groups)
        self.shared.remember(self._scans, ck, got)
        return got

    def _state_scan(self, lx: _Lexer, q: int) -> StateScan:
        """The whole vocabulary walked from DFA state ``q`` through the token trie (one gather
        per trie level over the live nodes; shared prefixes are walked once). Cached per
        (lexer, state) and shared by every grammar using the lexer."""
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
        alive_at: list[np.ndarray] = []  # live nodes, level by level
        left_at: list[np.ndarray] = []   # nodes (depth >= 2) where a walk leaves an accepting state
        left_from: list[np.ndarray] = []  # ... and that state
        alive = np.zeros(1, dtype=np.int64)  # live nodes of the level above
        for d in range(1, len(lv) - 1):
            a, b = lv[d], lv[d + 1]
            if alive.size * 8 > b - a:  # most of the level: one gather over all of it
                idx = None
                ps = state[tr.parent[a:b]]
                ns = flat[ps * 256 + tr.byte[a:b]]
                state[a:b] = ns
                alive = np.flatnonzero(ns) + a
            else:  # only the children of live nodes
                idx = expand_ranges(tr.child_start[alive], tr.child_count[alive])
                if not idx.size:
                    break
                ps = state[tr.parent[idx]]
                ns = flat[ps * 256 + tr.byte[idx]]
                state[idx] = ns
                alive = idx[ns != 0]
            if d > 1:  # (tokens ending the lexeme before their first byte: ``exit0``)
                leave = (ns == 0) & accepting[ps]
                if leave.any():
                    where = np.flatnonzero(leave)
                    left_at.append(where + a if idx is None else idx[where])
                    left_from.append(ps[where])
            if not alive.size:
                break  # every deeper node is dead (state 0 already)
            alive_at.append(alive)
        inside = np.zeros(v.vocab_size, dtype=bool)
        if alive_at:
            nodes = np.concatenate(alive_at)
            nodes = nodes[tr.exact[nodes] > 0]
            inside[tr.order[expand_ranges(tr.lo[nodes], tr.exact[nodes])]] = True
        groups = []
        if left_at:  # every token under such a node leaves there (kept sparse)
            nodes = np.concatenate(left_at)
            counts = tr.hi[nodes] - tr.lo[nodes]
            toks = tr.order[expand_ranges(tr.lo[nodes], counts)]
            prev = np.repeat(np.concatenate(left_from), counts)
            consumed = np.repeat(tr.depth[nodes] - 1, counts)
            for s in np.unique(prev).tolist():
                sel = prev == s
                groups.append((s, toks[sel], consumed[sel]))
        exit0 = None
        if accepting[q]:
            exit0 = (lx.table[q] == 0)[v.first_byte] & v.has_bytes
        got = StateScan(inside, exit0, groups)
        self.shared.remember(self._tries, key, got)
        return got

    def _row_scan(self, lx: _Lexer, start: int, fresh: bool, rows: np.ndarray, offs: np.ndarray):
        """Token suffixes (from ``offs``) through one lexer DFA from ``start``, row by row:
        (positions that leave the lexeme, the states they leave from, bytes consumed, ok)."""
        v = self.vocab
        if rows.size <= 512:  # few rows (the usual case): plain Python beats numpy's overhead
            return self._row_scan_small(lx, start, fresh, rows, offs)
        table = lx.table
        rem = v.lengths[rows] - offs
        states = np.full(rows.size, start, dtype=np.int64)
        ok = np.zeros(rows.size, dtype=bool)
        pos = np.arange(rows.size)
        cand_pos, cand_prev, cand_k = [], [], []
        k = 0
        while pos.size:
            done = rem[pos] <= k
            if done.any():
                ok[pos[done]] = True
                pos = pos[~done]
                if not pos.size:
                    break
            prev = states[pos]
            nxt = table[prev, v.bytes_matrix[rows[pos], offs[pos] + k]]
            dead = nxt == 0
            if dead.any():
                if k > 0 or not fresh:  # a lexeme can end here (never an empty one)
                    acc = lx.accepting[prev[dead]]
                    cand_pos.append(pos[dead][acc])
                    cand_prev.append(prev[dead][acc])
                    cand_k.append(np.full(int(acc.sum()), k, dtype=np.int64))
                live = ~dead
                pos = pos[live]
                nxt = nxt[live]
            states[pos] = nxt
            k += 1
        if not cand_pos:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e, ok
        return np.concatenate(cand_pos), np.concatenate(cand_prev), np.concatenate(cand_k), ok

    def _row_scan_small(self, lx: _Lexer, start: int, fresh: bool, rows: np.ndarray, offs: np.ndarray):
        tb = self.vocab.token_bytes
        table = lx.rows
        accepting = lx.accepting
        ok = np.zeros(rows.size, dtype=bool)
        cpos, cprev, ck = [], [], []
        for j, (row, off) in enumerate(zip(rows.tolist(), offs.tolist(), strict=True)):
            st = start
            data = tb[row]
            for k in range(len(data) - off):
                nxt = table[st][data[off + k]]
                if not nxt:
                    if (k > 0 or not fresh) and accepting[st]:
                        cpos.append(j)
                        cprev.append(st)
                        ck.append(k)
                    break
                st = nxt
            else:
                ok[j] = True
        mk = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        return mk(cpos), mk(cprev), mk(ck), ok


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
