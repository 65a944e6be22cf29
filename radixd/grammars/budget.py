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

from radixd.grammars.automaton import FRESH, Config, Matcher, TokenGrammar
from radixd.grammars.caches import lru_get, lru_put, remember
from radixd.grammars.lexers import Lexer

INF = 1 << 30  # no completion (or none within the search bound)


class _LexerPaths:
    """``dist[x, j]``: fewest bytes (each a single-byte token) from DFA state ``x`` to the
    accepting state ``acc[j]``; INF where unreachable."""

    def __init__(self, lx: Lexer, byte_ok: np.ndarray):
        table = lx.table
        n = table.shape[0]
        self.acc = np.flatnonzero(lx.accepting)
        by_byte = np.ascontiguousarray(table[:, byte_ok].T)  # one row per usable byte
        classes: dict[bytes, int] = {}
        for i, row in enumerate(by_byte):  # bytes that move every state alike: one column
            classes.setdefault(row.tobytes(), i)
        cols = by_byte[list(classes.values())].T if classes else np.zeros((n, 1), dtype=table.dtype)
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


class ClosingShared:
    """What the closing filter derives from a vocabulary and its lexers, shared by every
    grammar compiled for one vocabulary (keyed by the lexers' uids, which are never reused)."""

    def __init__(self, vocab, limit: int = 4096, scan_bytes: int = 128 << 20, token_costs: int = 64):
        self.vocab = vocab
        self.byte_ok = np.zeros(256, dtype=bool)  # bytes that are a token of their own
        for b in vocab.token_bytes:
            if b is not None and len(b) == 1:
                self.byte_ok[b[0]] = True
        tr = vocab.trie
        # tokens ending at each trie node: order[lo[n]:lo[n] + tokens_at[n]] (tokens without
        # bytes end at the root, which no walk visits)
        self.tokens_at = np.bincount(tr.end[vocab.has_bytes], minlength=tr.size)
        self.tokens_at[0] = 0
        self.first_token = tr.order[np.minimum(tr.lo, tr.order.size - 1)]
        extra = [(n, t) for n in np.flatnonzero(self.tokens_at > 1).tolist()
                 for t in tr.order[tr.lo[n] + 1:tr.lo[n] + self.tokens_at[n]].tolist()]
        self.extra_node = np.array([n for n, _ in extra], dtype=np.int64)
        self.extra_token = np.array([t for _, t in extra], dtype=np.int64)
        self.byte_l = tr.byte.tolist()
        self.tokens_at_l = self.tokens_at.tolist()
        self.child_start_l = tr.child_start.tolist()
        self.child_count_l = tr.child_count.tolist()
        self._accepting: dict[int, list[bool]] = {}
        self.root_children = np.arange(tr.child_start[0], tr.child_start[0] + tr.child_count[0], dtype=np.int64)
        self.limit = limit
        self._paths: dict[int, _LexerPaths] = {}
        self._enter: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._scans: dict[tuple, _Scan] = {}
        self._scan_bytes, self._scan_bytes_limit = 0, scan_bytes  # scans of string states are large
        # per-token costs of recently filtered configurations, all grammars together (one
        # int32 per vocabulary id each): (budget uid, configuration) -> costs
        self.token_costs: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.token_costs_size = token_costs
        self.uids = itertools.count()

    def _remember(self, cache: dict, key, value):
        return remember(cache, key, value, self.limit)

    def paths(self, lx: Lexer) -> _LexerPaths:
        got = self._paths.get(lx.uid)
        return got if got is not None else self._remember(self._paths, lx.uid, _LexerPaths(lx, self.byte_ok))

    def enter(self, prev: Lexer | None, s: int, nxt: Lexer) -> tuple[np.ndarray, np.ndarray]:
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

    def scan(self, key: tuple, lx: Lexer, nodes: np.ndarray, states: np.ndarray, fresh: bool) -> _Scan:
        """The token trie below ``nodes`` walked through ``lx`` (each node's byte read from
        ``states``), cached under ``key``: the chain of lexers and states that led to these
        nodes, which fixes them (the parser stacks along it do not matter)."""
        got = self._scans.get(key)
        if got is None:
            got = _Scan(lx, nodes, states, fresh, self)
            size = got.nodes.nbytes + got.states.nbytes + sum(n.nbytes for _, n in got.groups)
            if self._scan_bytes + size > self._scan_bytes_limit or len(self._scans) >= self.limit:
                self._scans.clear()
                self._scan_bytes = 0
            self._scans[key] = got
            self._scan_bytes += size
        return got

    def accepting_list(self, lx: Lexer) -> list[bool]:
        got = self._accepting.get(lx.uid)
        if got is None:
            got = self._remember(self._accepting, lx.uid, lx.accepting.tolist())
        return got

    def fill(self, out: np.ndarray, nodes: np.ndarray, values: np.ndarray) -> None:
        """``out[token] = value`` for every token that ends at one of ``nodes``."""
        out[self.first_token[nodes]] = values
        if self.extra_node.size:
            hit = np.isin(self.extra_node, nodes)
            if hit.any():
                where = dict(zip(nodes.tolist(), values.tolist(), strict=True))
                out[self.extra_token[hit]] = [where[n] for n in self.extra_node[hit].tolist()]


class _Scan:
    """Part of the token trie walked through one lexer: ``nodes`` where tokens end inside
    the lexeme and ``states``, the DFA states there (``ends``: the distinct ones); ``groups``:
    per accepting state ``s`` the walk leaves the lexeme from, the nodes whose byte starts
    the next lexeme (every token below them continues there)."""

    __slots__ = ("nodes", "states", "ends", "groups")

    def __init__(self, lx: Lexer, nodes: np.ndarray, states: np.ndarray, fresh: bool, sh: ClosingShared):
        tr = sh.vocab.trie
        flat, accepting, rows, acc = lx.flat, lx.accepting, lx.rows, sh.accepting_list(lx)
        ends_n: list = []   # numpy pieces and, from narrow levels, plain ints
        ends_s: list = []
        outs_n: list = []
        outs_s: list = []
        py_en, py_es, py_on, py_os = [], [], [], []
        first = True
        while len(nodes):
            skip_out = first and fresh  # (a lexeme is never empty)
            if len(nodes) <= 32:  # a narrow level: plain Python beats numpy's overhead
                byte, t_at, cs, cc = sh.byte_l, sh.tokens_at_l, sh.child_start_l, sh.child_count_l
                nxt_n, nxt_s = [], []
                for n, p in zip(_ints(nodes), _ints(states), strict=True):
                    q = rows[p][byte[n]]
                    if not q:
                        if not skip_out and acc[p]:
                            py_on.append(n)
                            py_os.append(p)
                        continue
                    if t_at[n]:
                        py_en.append(n)
                        py_es.append(q)
                    k = cc[n]
                    if k:
                        nxt_n.extend(range(cs[n], cs[n] + k))
                        nxt_s.extend([q] * k)
                nodes, states = nxt_n, nxt_s
            else:
                nodes, states = np.asarray(nodes, dtype=np.int64), np.asarray(states, dtype=np.int64)
                ns = flat[states * 256 + tr.byte[nodes]]
                if not skip_out:
                    out = (ns == 0) & accepting[states]
                    if out.any():
                        outs_n.append(nodes[out])
                        outs_s.append(states[out])
                live = ns != 0
                nodes, ns = nodes[live], ns[live]
                ending = sh.tokens_at[nodes] > 0
                ends_n.append(nodes[ending])
                ends_s.append(ns[ending])
                counts = tr.child_count[nodes]
                total = int(counts.sum())
                states = np.repeat(ns, counts)
                nodes = np.arange(total) + np.repeat(tr.child_start[nodes] - np.cumsum(counts) + counts, counts)
            first = False
        cat = lambda parts, py: np.concatenate([*parts, np.array(py, dtype=np.int64)]).astype(np.int32)  # noqa: E731
        self.nodes, self.states = cat(ends_n, py_en), cat(ends_s, py_es)
        self.ends = np.flatnonzero(np.bincount(self.states)) if self.states.size else self.states
        self.groups = []
        on, os_ = cat(outs_n, py_on), cat(outs_s, py_os)
        if on.size:
            for s in np.flatnonzero(np.bincount(os_)).tolist():
                self.groups.append((s, on[os_ == s]))


def _ints(xs) -> list[int]:
    return xs.tolist() if isinstance(xs, np.ndarray) else xs


class Budget:
    """The closing filter for one ``TokenGrammar`` (used from one thread, like the grammar).

    ``node_cap`` bounds one search (boundaries expanded); a search that hits it returns the
    cheapest completion it found so far (an upper bound, not cached as exact) or INF."""

    def __init__(self, grammar: TokenGrammar, shared: ClosingShared, node_cap: int = 4096):
        self.g = grammar
        self.shared = shared
        self.eos_cost = 1 if grammar.vocab.eos_ids else 0
        self.node_cap = node_cap
        self._memo: dict[tuple, int] = {}
        self._edges: dict[tuple, list] = {}
        self._state_costs: dict[tuple, np.ndarray] = {}
        self._max: dict[Config, int] = {}
        self.uid = next(shared.uids)
        self._tie = itertools.count()
        self.searches = 0  # boundary searches run
        self.capped = 0    # of which stopped at node_cap
        self.filtered = 0  # masks the filter narrowed

    # -------------------------------------------------------------- the search

    def _end_cost(self, lx: Lexer, s: int | None, stack: tuple) -> int:
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
        return remember(self._edges, node, out, 65536)

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
            remember(self._state_costs, key, got, 65536)
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

    def warm(self) -> None:
        """Part of compiling (off the event loop): the cost of the start and of every token
        from it, which runs the searches along the grammar's shortest documents."""
        self.cost(self.g.start)
        self.max_cost(self.g.start)

    # -------------------------------------------------------------- per token

    def _first_scan(self, config: Config) -> tuple[tuple, _Scan]:
        stack, ign, lex = config
        lx = self.g.lexer(stack, ign)
        start, fresh = (1, True) if lex == FRESH else (lex, False)
        key = (lx.uid, start, fresh)
        nodes = self.shared.root_children
        return key, self.shared.scan(key, lx, nodes, np.full(nodes.size, start, dtype=np.int64), fresh)

    def _next_scans(self, stack: tuple, ign: bool, key: tuple, scan: _Scan):
        """Per group of trie nodes where the walk leaves the lexeme: (stack and ignore_ok
        after it, the key and scan of the walk on from there)."""
        g = self.g
        for s, nodes in scan.groups:
            r = g.end_lexeme(stack, ign, s)
            if r is not None:
                lx2 = g.lexer(*r)
                k2 = (key, s, lx2.uid)
                yield r, k2, self.shared.scan(k2, lx2, nodes, np.ones(nodes.size, dtype=np.int64), True)

    def token_costs(self, config: Config) -> np.ndarray:
        """[vocab] cost of the configuration after each token (INF: not consumable)."""
        lru, ck = self.shared.token_costs, (self.uid, config)
        got = lru_get(lru, ck)
        if got is not None:
            return got
        key, scan = self._first_scan(config)
        got = np.full(self.g.vocab.vocab_size, INF, dtype=np.int32)
        self._costs(config[0], config[1], key, scan, got)
        return lru_put(lru, ck, got, self.shared.token_costs_size)

    def _costs(self, stack: tuple, ign: bool, key: tuple, scan: _Scan, out: np.ndarray) -> None:
        if scan.nodes.size:
            self.shared.fill(out, scan.nodes, self.state_costs(stack, ign)[scan.states])
        for (st2, ig2), k2, sub in self._next_scans(stack, ign, key, scan):
            self._costs(st2, ig2, k2, sub, out)

    def _largest(self, stack: tuple, ign: bool, key: tuple, scan: _Scan) -> int:
        best = int(self.state_costs(stack, ign)[scan.ends].max()) if scan.ends.size else 0
        for (st2, ig2), k2, sub in self._next_scans(stack, ign, key, scan):
            best = max(best, self._largest(st2, ig2, k2, sub))
        return best

    def max_cost(self, config: Config) -> int:
        """The largest cost after any token the grammar allows here (EOS aside): with at
        least this many tokens left after the next one, the filter removes nothing."""
        got = self._max.get(config)
        if got is None:
            key, scan = self._first_scan(config)
            got = remember(self._max, config, self._largest(config[0], config[1], key, scan), 262144)
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
        np.less_equal(c, room, out=out)
        out &= allowed
        eos = self.g.eos
        out[eos] = allowed[eos]
        if not out.any() and allowed.any():
            sel = allowed.copy()
            sel[eos] = False
            np.equal(c, c[sel].min(), out=out)
            out &= sel


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
