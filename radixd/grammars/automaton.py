"""A compiled grammar's configurations and token masks: a lexer + LALR parser over bytes.

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

This module holds a compiled grammar's configurations (stepping, masks, the warm-up at compile
time: ``TokenGrammar``) and one sequence's position in it (``Matcher``). The lexers and the
stack-independent vocabulary walks are ``lexers``'; the parsers are ``parsers``'.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict

import numpy as np

from radixd.grammars.caches import lru_get, lru_put, remember
from radixd.grammars.lexers import Lexer, SharedLexers, Terminal, lexeme_walk, state_scan
from radixd.grammars.parsers import Parser
from radixd.grammars.vocab import TokenizerInfo

FRESH = -1
Config = tuple  # (stack, ignore_ok, lex)


class _Follow:
    """For warming up: the lexers that may come after a lexeme, from the parse table alone
    (a terminal's shift targets; after an ignored terminal, the same parser state without
    the ignored ones). A superset of what a parser stack allows (LALR lookaheads)."""

    def __init__(self, g: TokenGrammar, actions: dict):
        self.ignore = g.ignore
        self.after: dict[int, dict[int, Lexer]] = {}
        for acts in actions.values():
            for t, act in acts.items():
                if act[0]:  # shift to state act[1]
                    cands = frozenset(g.parser.candidates((act[1],)))
                    lx = g._lexers.get(cands | g.ignore) if cands else None
                    if lx is not None:
                        self.after.setdefault(t, {})[lx.uid] = lx
        self.plain = {lx.uid: g._lexers.get(terms - g.ignore) for terms, lx in g._lexers.items()}

    def lexers(self, lx: Lexer, s: int) -> list[Lexer]:
        out: dict[int, Lexer] = {}
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

    def __init__(self, terminals: list[Terminal], parser: Parser, vocab: TokenizerInfo, ignore: frozenset[int] = frozenset(),
                 mask_cache_size: int = 1024, shared: SharedLexers | None = None, tight: frozenset[int] = frozenset()):
        self.terminals = terminals
        self.parser = parser
        self.vocab = vocab
        self.ignore = ignore
        self.tight = tight  # terminals that no ignored one may precede (a structural tag's literals)
        self.start: Config = (parser.start, True, FRESH)
        self._lexers: dict[frozenset[int], Lexer] = {}
        self._lexer_of: dict[tuple, Lexer] = {}
        self._acceptable: dict[tuple, frozenset[int]] = {}
        self._ends: dict[tuple, tuple | None] = {}
        self._masks: OrderedDict[Config, tuple[np.ndarray, bool]] = OrderedDict()
        self._mask_cache_size = mask_cache_size
        self._steps: dict[tuple, Config | None] = {}
        self._fresh: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._fresh_cache_size = max(64, mask_cache_size // 4)
        self.shared = shared if shared is not None else SharedLexers()
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

    def lexer(self, stack: tuple, ignore_ok: bool) -> Lexer:
        key = (stack, ignore_ok)
        lx = self._lexer_of.get(key)
        if lx is None:
            acceptable = self.acceptable(stack)
            if self.tight and acceptable <= self.tight:
                ignore_ok = False
            terms = acceptable | (self.ignore if ignore_ok else frozenset())
            lx = self._lexers.get(terms)
            if lx is None:
                lx = self._lexers[terms] = Lexer(self.shared, tuple(sorted(terms)), self.terminals)
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
        actions = self.parser.actions
        for top in actions:
            cands = frozenset(self.parser.candidates((top,)))
            if not cands:
                continue
            for terms in (cands | self.ignore, cands):
                lx = self._lexers.get(terms)
                if lx is None:
                    lx = self._lexers[terms] = Lexer(self.shared, tuple(sorted(terms)), self.terminals)
                    lexers.append(lx)
        follow = _Follow(self, actions)
        frontier = [(lx, 1) for lx in lexers]
        seen = {(lx.uid, 1) for lx in lexers}
        while frontier:  # breadth first over every lexer's DFA at once (every start state)
            after = []
            for lx, q in frontier:
                if q != 1 and time.thread_time() > deadline:
                    return
                sc = state_scan(self.shared, self.vocab, lx, q)
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

    def _warm_continue(self, lx: Lexer, prefix: tuple, groups: list, follow: _Follow, depth: int,
                       deadline: float) -> None:
        """The ``_continue`` scans of ``groups`` (left from ``lx``; their keys ``prefix + (s,)``)
        through each lexer that may follow, ``depth`` lexemes on."""
        for s, nodes in groups:
            key = prefix + (s,)
            for nxt in follow.lexers(lx, s):
                if time.thread_time() > deadline:
                    return
                got = lexeme_walk(self.shared, self.vocab, nxt, key, nodes)
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
        got = lru_get(self._masks, config)
        if got is not None:
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
        return lru_put(self._masks, config, (allowed, terminated), self._mask_cache_size)

    def _vocab_walk(self, stack: tuple, ign: bool, lex: int) -> np.ndarray:
        """Which tokens of the whole vocabulary can be consumed from the configuration (a new
        array). The lexer's scan from ``lex`` says which tokens stay inside the lexeme, which
        end it before their first byte (they continue whole from the configuration after the
        lexeme: its own vocabulary walk, cached) and which leave it later (the trie below
        the nodes where they leave is walked on from the configuration after the lexeme)."""
        lx = self.lexer(stack, ign)
        q = 1 if lex == FRESH else lex
        sc = state_scan(self.shared, self.vocab, lx, q)
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
        got = lru_get(self._fresh, after)
        if got is None:
            got = lru_put(self._fresh, after, self._vocab_walk(after[0], after[1], FRESH), self._fresh_cache_size)
        return got

    def _continue(self, after: tuple, nodes: np.ndarray, key: tuple) -> np.ndarray:
        """Token ids below trie ``nodes`` that can be consumed from the start of a lexeme in
        (stack, ignore_ok) ``after``, reading from each node's byte on. ``key`` names the
        nodes (the scans that left there), for the stack-independent scan cache."""
        stack, ign = after
        lx = self.lexer(stack, ign)
        inside, groups = lexeme_walk(self.shared, self.vocab, lx, key, nodes)
        if not groups:
            return inside
        parts = [inside]
        for s, sub in groups:
            r = self.end_lexeme(stack, ign, s)
            if r is not None:
                parts.append(self._continue(r, sub, (key, lx.uid, s)))
        return np.concatenate(parts)

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

    def fork(self) -> Matcher:
        """A matcher at the same position (``Forks``: configurations are immutable tuples)."""
        return copy.copy(self)
