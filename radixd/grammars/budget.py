"""Closing a document before the token budget runs out.

``cost(config)``: the fewest tokens that complete a document from a matcher configuration,
counting one token per byte (only bytes that are a token of their own, so the count is one
the model can really emit) plus one for the EOS when the document may end but is not
*finished* (``TokenGrammar.finished``: the request stops by itself). With ``r`` tokens left,
the closing filter allows only the tokens ``t`` of the grammar mask with
``cost(step(config, t)) <= r - 1`` (EOS stays allowed wherever the grammar allows it). If
``cost(start) <= max_tokens``, every step keeps at least one token (the first byte of a
cheapest completion), so the output is a complete document when the budget ends.

The search runs over *boundaries*: (stack, ignore_ok, s) = the current lexeme has just ended
in accepting state ``s`` of its lexer. Inside a lexer, ``_LexerPaths`` holds the fewest bytes
from each DFA state to each accepting state; from a boundary, the next lexeme starts with a
byte that cannot extend the one that ended (longest match, exactly as ``advance`` lexes) and
runs to one of its accepting states. So the search follows ``TokenGrammar.advance``, and the
completion bytes it finds (``completion``) replay through it.

Costs are cached: per boundary (exact, Dijkstra with the tails of earlier searches reused),
per (stack, ignore_ok) the cost from every DFA state of its lexer, per configuration the
largest cost over its allowed tokens (so most steps check one integer and filter nothing)
and, in a small LRU, the cost of every token (computed vectorized like the mask: tokens that
end inside the current lexeme are priced by the DFA state they end in, tokens that cross a
lexeme boundary are walked on from the configuration after it).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

import numpy as np

from radixd.grammars.automaton import FRESH, Config, Matcher, TokenGrammar, _Lexer

INF = 1 << 30  # no completion (or none within the search bound)


class _LexerPaths:
    """``dist[x, j]``: fewest bytes (each a single-byte token) from DFA state ``x`` to the
    accepting state ``acc[j]``; INF where unreachable."""

    def __init__(self, lx: _Lexer, byte_ok: np.ndarray):
        table = lx.table
        n = table.shape[0]
        self.acc = np.flatnonzero(lx.accepting)
        cols = np.unique(table[:, byte_ok], axis=1) if byte_ok.any() else np.zeros((n, 1), dtype=table.dtype)
        dist = np.full((n, self.acc.size), INF, dtype=np.int64)
        front = np.zeros((n, self.acc.size), dtype=bool)
        front[self.acc, np.arange(self.acc.size)] = True
        dist[front] = 0
        k = 0
        while front.any():  # backwards BFS to every accepting state at once
            k += 1
            front = front[cols].any(axis=1)
            front[0] = False
            front &= dist == INF
            dist[front] = k
        self.dist = dist
        self.to_any = dist.min(axis=1) if self.acc.size else np.full(n, INF, dtype=np.int64)


class ClosingShared:
    """What the closing filter derives from a vocabulary and its lexers, shared by every
    grammar compiled for one vocabulary (keyed by the lexers' uids, which are never reused)."""

    def __init__(self, vocab, limit: int = 4096):
        self.vocab = vocab
        self.byte_ok = np.zeros(256, dtype=bool)  # bytes that are a token of their own
        for b in vocab.token_bytes:
            if b is not None and len(b) == 1:
                self.byte_ok[b[0]] = True
        self.limit = limit
        self._paths: dict[int, _LexerPaths] = {}
        self._enter: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._scans: dict[tuple, _Scan] = {}

    def _remember(self, cache: dict, key, value):
        if len(cache) >= self.limit:
            cache.clear()
        cache[key] = value
        return value

    def paths(self, lx: _Lexer) -> _LexerPaths:
        got = self._paths.get(lx.uid)
        return got if got is not None else self._remember(self._paths, lx.uid, _LexerPaths(lx, self.byte_ok))

    def enter(self, prev: _Lexer | None, s: int, nxt: _Lexer) -> tuple[np.ndarray, np.ndarray]:
        """The lexeme after one that ended in state ``s`` of ``prev`` (None: nothing before):
        (accepting states of ``nxt``, fewest bytes to reach each), finite ones only. Its first
        byte must not extend the lexeme before (longest match)."""
        key = (None if prev is None else prev.uid, s, nxt.uid)
        got = self._enter.get(key)
        if got is not None:
            return got
        first = self.byte_ok & (nxt.table[1] != 0)
        if prev is not None:
            first &= prev.table[s] == 0
        p = self.paths(nxt)
        ys = np.unique(nxt.table[1][first])
        if ys.size and p.acc.size:
            cost = 1 + p.dist[ys].min(axis=0)
            fin = cost < INF
            got = (p.acc[fin], cost[fin])
        else:
            e = np.zeros(0, dtype=np.int64)
            got = (e, e)
        return self._remember(self._enter, key, got)

    def scan(self, key: tuple, lx: _Lexer, start: int, fresh: bool, rows: np.ndarray | None,
             offs: np.ndarray | None) -> _Scan:
        """The tokens ``rows`` (None: the whole vocabulary) from byte ``offs`` walked through
        ``lx`` from ``start``, cached under ``key``: the chain of lexers and states that led
        to these rows, which fixes them (the parser stacks along it do not matter)."""
        got = self._scans.get(key)
        if got is None:
            v = self.vocab
            if rows is None:
                rows = np.arange(v.vocab_size, dtype=np.int64)
                walked = trie_walk(lx, start, fresh, v)
                offs = np.zeros_like(rows)
            else:
                walked = walk(lx, start, fresh, v, rows, offs)
            got = self._remember(self._scans, key, _Scan(walked, rows, offs))
        return got


class _Scan:
    """Tokens walked through one lexer: ``end`` per row (the DFA state a token ends in inside
    the lexeme, 0 if it leaves or dies), ``ends`` the distinct nonzero ones, and per state
    ``s`` the token leaves from: (s, positions among the rows, their token ids, the byte
    offsets they continue from)."""

    __slots__ = ("end", "ends", "groups")

    def __init__(self, walked: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray, offs: np.ndarray):
        end, leave, took = walked
        self.end = end.astype(np.int32)
        present = np.bincount(end)
        present[0] = 0
        self.ends = np.flatnonzero(present)
        self.groups = []
        crossing = np.flatnonzero(leave >= 0)
        if crossing.size:
            states = leave[crossing]
            for s in np.flatnonzero(np.bincount(states)).tolist():
                pos = crossing[states == s]
                self.groups.append((s, pos, rows[pos], offs[pos] + took[pos]))


def trie_walk(lx: _Lexer, start: int, fresh: bool, v):
    """The whole vocabulary walked through ``lx`` from ``start`` along the token trie
    (shared prefixes once, only the children of live nodes): per token id (end state inside
    the lexeme or 0; the accepting state it leaves from or -1; bytes before leaving)."""
    tr = v.trie
    state = np.zeros(tr.size, dtype=np.int64)
    state[0] = start
    alive = np.zeros(1, dtype=np.int64)
    nodes, prevs, depths = [], [], []
    for d in range(1, len(tr.levels) - 1):
        counts = tr.child_count[alive]
        total = int(counts.sum())
        if total == 0:
            break
        idx = np.arange(total) + np.repeat(tr.child_start[alive] - np.cumsum(counts) + counts, counts)
        ps = state[tr.parent[idx]]
        ns = lx.flat[ps * 256 + tr.byte[idx]]
        state[idx] = ns
        if d > 1 or not fresh:  # a lexeme is never empty
            out = (ns == 0) & lx.accepting[ps]
            if out.any():
                nodes.append(idx[out])
                prevs.append(ps[out])
                depths.append(d - 1)
        alive = idx[ns != 0]
    end = state[tr.end]
    end[~v.has_bytes] = 0
    leave = np.full(v.vocab_size, -1, dtype=np.int64)
    took = np.zeros(v.vocab_size, dtype=np.int64)
    for ns_, ps_, k in zip(nodes, prevs, depths, strict=True):  # the tokens under each node
        toks = [tr.order[tr.lo[n]:tr.hi[n]] for n in ns_.tolist()]
        counts = np.array([t.size for t in toks], dtype=np.int64)
        ids = np.concatenate(toks)
        leave[ids] = np.repeat(ps_, counts)
        took[ids] = k
    leave[~v.has_bytes] = -1
    return end, leave, took


def walk(lx: _Lexer, start: int, fresh: bool, v, rows: np.ndarray, offs: np.ndarray):
    """``trie_walk`` for token suffixes: ``rows`` (token ids) from byte ``offs``."""
    if rows.size <= 256:  # few rows (the usual case): plain Python beats numpy's overhead
        return _walk_small(lx, start, fresh, v, rows, offs)
    n = rows.size
    rem = v.lengths[rows] - offs
    end = np.zeros(n, dtype=np.int64)
    leave = np.full(n, -1, dtype=np.int64)
    took = np.zeros(n, dtype=np.int64)
    state = np.full(n, start, dtype=np.int64)
    pos = np.flatnonzero(rem > 0)  # tokens without bytes are never consumed
    k = 0
    while pos.size:
        done = rem[pos] <= k
        if done.any():
            end[pos[done]] = state[pos[done]]
            pos = pos[~done]
            if not pos.size:
                break
        prev = state[pos]
        nxt = lx.table[prev, v.bytes_matrix[rows[pos], offs[pos] + k]]
        dead = nxt == 0
        if dead.any():
            if k > 0 or not fresh:  # a lexeme is never empty
                d = pos[dead]
                acc = lx.accepting[prev[dead]]
                leave[d[acc]] = prev[dead][acc]
                took[d[acc]] = k
            pos, nxt = pos[~dead], nxt[~dead]
        state[pos] = nxt
        k += 1
    return end, leave, took


def _walk_small(lx: _Lexer, start: int, fresh: bool, v, rows: np.ndarray, offs: np.ndarray):
    table, accepting, tb = lx.rows, lx.accepting, v.token_bytes
    end, leave, took = [], [], []
    for row, off in zip(rows.tolist(), offs.tolist(), strict=True):
        st, e, lv, k = start, 0, -1, 0
        data = tb[row]
        for k in range(len(data) - off):
            nxt = table[st][data[off + k]]
            if not nxt:
                if (k > 0 or not fresh) and accepting[st]:
                    lv = st
                break
            st = nxt
        else:
            e = st if data and len(data) > off else 0
        end.append(e)
        leave.append(lv)
        took.append(k if lv >= 0 else 0)
    mk = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
    return mk(end), mk(leave), mk(took)


class Budget:
    """The closing filter for one ``TokenGrammar`` (used from one thread, like the grammar).

    ``node_cap`` bounds one search (boundaries expanded); a search that hits it returns the
    cheapest completion it found so far (an upper bound, not cached as exact) or INF."""

    def __init__(self, grammar: TokenGrammar, shared: ClosingShared, node_cap: int = 4096,
                 token_cache_size: int = 64):
        self.g = grammar
        self.shared = shared
        self.eos_cost = 1 if grammar.vocab.eos_ids else 0
        self.node_cap = node_cap
        self._memo: dict[tuple, int] = {}
        self._edges: dict[tuple, list] = {}
        self._state_costs: dict[tuple, np.ndarray] = {}
        self._max: dict[Config, int] = {}
        self._tokens: OrderedDict[Config, np.ndarray] = OrderedDict()
        self._token_cache_size = token_cache_size
        self._tie = itertools.count()
        self.searches = 0  # boundary searches run
        self.capped = 0    # of which stopped at node_cap
        self.filtered = 0  # masks the filter narrowed

    # -------------------------------------------------------------- the search

    def _end_cost(self, lx: _Lexer, s: int | None, stack: tuple) -> int:
        """Tokens to end here once the lexeme (ended in ``s``; None: no lexeme) left ``stack``."""
        g = self.g
        if not g.parser.accepts_end(stack):
            return INF
        live = s is not None and bool(lx.dfa.live[s])
        return 0 if not live and not g.acceptable(stack) else self.eos_cost

    def edges(self, node: tuple) -> list:
        """From boundary ``node``: [(next boundary or None for the end, tokens)]."""
        got = self._edges.get(node)
        if got is not None:
            return got
        g = self.g
        stack, ign, s = node
        lx = g.lexer(stack, ign)
        out = []
        r = g.end_lexeme(stack, ign, s)
        if r is not None:
            st2, ig2 = r
            c = self._end_cost(lx, s, st2)
            if c < INF:
                out.append((None, c))
            acc, cost = self.shared.enter(lx, s, g.lexer(st2, ig2))
            out.extend(((st2, ig2, s2), c2) for s2, c2 in zip(acc.tolist(), cost.tolist(), strict=True))
        if len(self._edges) > 65536:
            self._edges.clear()
        self._edges[node] = out
        return out

    def boundary_cost(self, node: tuple) -> int:
        """Fewest tokens from boundary ``node`` to a complete document (Dijkstra)."""
        got = self._memo.get(node)
        if got is not None:
            return got
        self.searches += 1
        memo = self._memo
        best, best_at = INF, None
        g_of = {node: 0}
        parent: dict[tuple, tuple | None] = {node: None}
        heap = [(0, 0, node)]
        expanded = 0
        capped = False
        while heap:
            d, _, v = heapq.heappop(heap)
            if d >= best:
                break
            if d > g_of[v]:
                continue
            tail = memo.get(v) if v is not node else None
            if tail is not None:
                if d + tail < best:
                    best, best_at = d + tail, v
                continue
            expanded += 1
            if expanded > self.node_cap:
                capped = True
                break
            for w, c in self.edges(v):
                nd = d + c
                if w is None:
                    if nd < best:
                        best, best_at = nd, v
                elif nd < g_of.get(w, INF) and nd < best:
                    g_of[w] = nd
                    parent[w] = v
                    heapq.heappush(heap, (nd, next(self._tie), w))
        if capped:
            self.capped += 1
            return best
        if len(memo) > 262144:
            memo.clear()
        if best_at is None:
            memo[node] = INF
            return INF
        v = best_at
        while v is not None:  # every boundary on the cheapest path: its tail is exact too
            memo[v] = best - g_of[v]
            v = parent[v]
        return best

    def state_costs(self, stack: tuple, ign: bool) -> np.ndarray:
        """Per DFA state ``x`` of the lexer at (stack, ign): cost of the configuration
        (stack, ign, x)."""
        key = (stack, ign)
        got = self._state_costs.get(key)
        if got is None:
            lx = self.g.lexer(stack, ign)
            p = self.shared.paths(lx)
            tails = np.array([self.boundary_cost((stack, ign, int(s))) for s in p.acc], dtype=np.int64)
            if p.acc.size:
                got = np.minimum((p.dist + tails[None, :]).min(axis=1), INF)
            else:
                got = np.full(lx.table.shape[0], INF, dtype=np.int64)
            got[0] = INF
            if len(self._state_costs) > 65536:
                self._state_costs.clear()
            self._state_costs[key] = got
        return got

    def cost(self, config: Config) -> int:
        """Fewest tokens (single-byte tokens, plus an EOS if one is needed) to a complete document."""
        stack, ign, lex = config
        if lex != FRESH:
            return int(self.state_costs(stack, ign)[lex])
        g = self.g
        lx = g.lexer(stack, ign)
        best = self._end_cost(lx, None, stack)
        if best == INF:  # a terminal matching the empty string
            r = g.end_lexeme(stack, ign, 1)
            if r is not None and g.parser.accepts_end(r[0]):
                best = self.eos_cost
        acc, c = self.shared.enter(None, 0, lx)
        for s, c2 in zip(acc.tolist(), c.tolist(), strict=True):
            best = min(best, c2 + self.boundary_cost((stack, ign, s)))
        return best

    def completion(self, config: Config) -> tuple[bytes, bool] | None:
        """A cheapest completion: (bytes, whether an EOS ends it) or None; greedy along the
        exact costs (each byte goes to a configuration one cheaper)."""
        g = self.g
        want = self.cost(config)
        if want >= INF:
            return None
        out = bytearray()
        while want > 0:
            if want == self.eos_cost and g.end_ok(config) and not g.finished(config):
                return bytes(out), True
            for b in np.flatnonzero(self.shared.byte_ok).tolist():
                nxt = g.advance(config, bytes([b]))
                if nxt is not None and self.cost(nxt) == want - 1:
                    out.append(b)
                    config, want = nxt, want - 1
                    break
            else:
                return None
        return bytes(out), False

    # -------------------------------------------------------------- per token

    def _first_scan(self, config: Config) -> tuple[tuple, _Scan]:
        stack, ign, lex = config
        lx = self.g.lexer(stack, ign)
        start, fresh = (1, True) if lex == FRESH else (lex, False)
        key = (lx.uid, start, fresh)
        return key, self.shared.scan(key, lx, start, fresh, None, None)

    def _next_scans(self, stack: tuple, ign: bool, key: tuple, scan: _Scan):
        """Per group of tokens that leave the lexeme: (positions, stack and ignore_ok after
        it, the key and scan of their walk on from there)."""
        g = self.g
        for s, pos, rows, offs in scan.groups:
            r = g.end_lexeme(stack, ign, s)
            if r is not None:
                lx2 = g.lexer(*r)
                k2 = (key, s, lx2.uid)
                yield pos, r, k2, self.shared.scan(k2, lx2, 1, True, rows, offs)

    def token_costs(self, config: Config) -> np.ndarray:
        """[vocab] cost of the configuration after each token (INF: not consumable)."""
        got = self._tokens.get(config)
        if got is not None:
            self._tokens.move_to_end(config)
            return got
        key, scan = self._first_scan(config)
        got = self._costs(config[0], config[1], key, scan)
        self._tokens[config] = got
        if len(self._tokens) > self._token_cache_size:
            self._tokens.popitem(last=False)
        return got

    def _costs(self, stack: tuple, ign: bool, key: tuple, scan: _Scan) -> np.ndarray:
        out = np.full(scan.end.size, INF, dtype=np.int64)
        inside = np.flatnonzero(scan.end)
        if inside.size:
            out[inside] = self.state_costs(stack, ign)[scan.end[inside]]
        for pos, (st2, ig2), k2, sub in self._next_scans(stack, ign, key, scan):
            out[pos] = self._costs(st2, ig2, k2, sub)
        return out

    def _largest(self, stack: tuple, ign: bool, key: tuple, scan: _Scan) -> int:
        best = int(self.state_costs(stack, ign)[scan.ends].max()) if scan.ends.size else 0
        for _, (st2, ig2), k2, sub in self._next_scans(stack, ign, key, scan):
            best = max(best, self._largest(st2, ig2, k2, sub))
        return best

    def max_cost(self, config: Config) -> int:
        """The largest cost after any token the grammar allows here (EOS aside): with at
        least this many tokens left after the next one, the filter removes nothing."""
        got = self._max.get(config)
        if got is None:
            key, scan = self._first_scan(config)
            got = self._largest(config[0], config[1], key, scan)
            if len(self._max) > 262144:
                self._max.clear()
            self._max[config] = got
        return got

    def restrict(self, config: Config, allowed: np.ndarray, out: np.ndarray, tokens_left: int) -> None:
        """``out`` = ``allowed`` less the tokens after which the document cannot close within
        ``tokens_left - 1`` more tokens. Never empty where ``allowed`` is not: when no token
        fits (the budget was too small from the start), the cheapest ones stay."""
        room = tokens_left - 1
        if room >= self.max_cost(config):
            out[:] = allowed
            return
        self.filtered += 1
        c = self.token_costs(config)
        fit = allowed & (c <= room)
        eos = self.g.eos
        fit[eos] = allowed[eos]
        if not fit.any() and allowed.any():
            sel = allowed.copy()
            sel[eos] = False
            fit = sel & (c == c[sel].min())
        out[:] = fit


class ClosingMatcher(Matcher):
    """A ``Matcher`` with the optional ``fill_mask_within`` capability: the mask less the
    tokens after which the document could not close within the tokens left."""

    __slots__ = ("budget",)

    def __init__(self, grammar: TokenGrammar, budget: Budget):
        super().__init__(grammar)
        self.budget = budget

    def fill_mask_within(self, out: np.ndarray, tokens_left: int) -> None:
        """As ``fill_mask``, with ``tokens_left`` tokens (this one included) still to come."""
        if self.done:
            self.fill_mask(out)
            return
        self.budget.restrict(self.config, self.allowed(), out, tokens_left)
