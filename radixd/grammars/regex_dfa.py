"""Regular expressions -> byte-level DFAs.

Python regex syntax (parsed by the standard library's ``re`` parser) is compiled to a
Thompson NFA over UTF-8 *bytes* (a code point range becomes the byte-range sequences that
encode it), then determinized by subset construction over byte equivalence classes. Several
patterns can be compiled into one DFA (a lexer): each state knows which patterns accept there.

The whole text must match (``^``/``$``/``\\A``/``\\Z`` are accepted and ignored). ``\\d``, ``\\w``,
``\\s`` are ASCII classes. A look-ahead that runs to the end of the text, ``(?=A\\Z)`` or
``(?!A\\Z)``, is supported where nothing but the rest of the text follows it (at the top level,
or in a top-level group or alternative): ``X(?=A\\Z)Y`` is X followed by what both Y and A
match (a product DFA, an intersection), ``X(?!A\\Z)Y`` by what Y matches and A does not (a
difference), exactly Python's meaning. Other look-around, backreferences, word boundaries and
case-insensitive matching are refused with ``RegexError`` naming the construct.

State 0 of every DFA is the dead state; state 1 is the start state.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

try:  # Python >= 3.11
    import re._constants as C
    import re._parser as P
except ImportError:  # pragma: no cover
    import sre_constants as C
    import sre_parse as P

MAX_CODEPOINT = 0x10FFFF
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000


class RegexError(ValueError):
    """A pattern that cannot be compiled (syntax, or a construct radixd does not support)."""


# ---------------------------------------------------------------------------------------------
# Code point sets
# ---------------------------------------------------------------------------------------------

_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_ALL = [(0, 0xD7FF), (0xE000, MAX_CODEPOINT)]


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, nxt = [], 0
    for lo, hi in _normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return _intersect(out, _ALL)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in a:
        for lo2, hi2 in b:
            lo3, hi3 = max(lo, lo2), min(hi, hi2)
            if lo3 <= hi3:
                out.append((lo3, hi3))
    return _normalize(out)


def _category(cat) -> list[tuple[int, int]]:
    table = {
        C.CATEGORY_DIGIT: _DIGIT, C.CATEGORY_WORD: _WORD, C.CATEGORY_SPACE: _SPACE,
        C.CATEGORY_NOT_DIGIT: _complement(_DIGIT), C.CATEGORY_NOT_WORD: _complement(_WORD),
        C.CATEGORY_NOT_SPACE: _complement(_SPACE),
    }
    if cat not in table:
        raise RegexError(f"unsupported character category {cat}")
    return table[cat]


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The byte-range sequences whose concatenations are exactly the UTF-8 encodings of the
    code points in [lo, hi] (no surrogates inside)."""
    out: list[list[tuple[int, int]]] = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        split = False
        for bound in (0x7F, 0x7FF, 0xFFFF):  # encoded length changes here
            if lo <= bound < hi:
                stack += [(bound + 1, hi), (lo, bound)]
                split = True
                break
        if split:
            continue
        n = len(chr(lo).encode())
        for i in range(1, n):  # make every continuation byte range full or a single prefix
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack += [((lo | m) + 1, hi), (lo, lo | m)]
                    split = True
                    break
                if hi & m != m:
                    stack += [(hi & ~m, hi), (lo, (hi & ~m) - 1)]
                    split = True
                    break
        if split:
            continue
        a, b = chr(lo).encode(), chr(hi).encode()
        out.append([(a[k], b[k]) for k in range(n)])
    return out


# ---------------------------------------------------------------------------------------------
# NFA
# ---------------------------------------------------------------------------------------------


class _NFA:
    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []   # (byte lo, byte hi, target)
        self.eps: list[list[int]] = []
        self.accept: dict[int, int] = {}                    # NFA state -> pattern index

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise RegexError(f"the pattern is too large (over {MAX_NFA_STATES} automaton states)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    # Each builder returns (start, end) of a fragment.

    def charset(self, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        s, e = self.state(), self.state()
        for lo, hi in _intersect(ranges, _ALL):
            for seq in utf8_sequences(lo, hi):
                cur = s
                for k, (blo, bhi) in enumerate(seq):
                    nxt = e if k == len(seq) - 1 else self.state()
                    self.edges[cur].append((blo, bhi, nxt))
                    cur = nxt
        return s, e

    def literal_bytes(self, data: bytes) -> tuple[int, int]:
        s = cur = self.state()
        for b in data:
            nxt = self.state()
            self.edges[cur].append((b, b, nxt))
            cur = nxt
        return s, cur

    def build(self, sub, dotall: bool, tail: bool = False) -> tuple[int, int]:
        """A sequence; ``tail``: nothing but the end of the text follows it."""
        items = list(sub)
        last = max((k for k, (op, _) in enumerate(items) if op is not C.AT), default=-1)
        s = cur = self.state()
        for k, (op, av) in enumerate(items):
            if op in (C.ASSERT, C.ASSERT_NOT) and av[0] == 1 and tail:
                fs, fe = self.lookahead(op is C.ASSERT, av[1], items[k + 1:], dotall)
                self.eps[cur].append(fs)
                return s, fe
            fs, fe = self.node(op, av, dotall, tail and k >= last)
            self.eps[cur].append(fs)
            cur = fe
        return s, cur

    def lookahead(self, positive: bool, cond, rest: list, dotall: bool) -> tuple[int, int]:
        """``(?=cond\\Z)rest`` (intersection) or ``(?!cond\\Z)rest`` (difference)."""
        cond = list(cond)
        if not _ends_at_end(cond):
            raise RegexError("a look-ahead must run to the end of the text: write (?=...\\Z) or (?!...\\Z)")
        rest_dfa, cond_dfa = _sub_dfa(rest, dotall), _sub_dfa(cond, dotall)
        return self.embed(product(rest_dfa, cond_dfa, "and" if positive else "minus"))

    def embed(self, dfa: DFA) -> tuple[int, int]:
        """A DFA as a fragment (its states become NFA states; accepting ones lead to the end)."""
        ids = [0] + [self.state() for _ in range(1, dfa.num_states)]
        e = self.state()
        table = dfa.table
        cuts = table[:, 1:] != table[:, :-1]  # byte b+1 starts a new run of targets
        for st in range(1, dfa.num_states):
            starts = [0] + (np.flatnonzero(cuts[st]) + 1).tolist()
            ends = starts[1:] + [256]
            row = table[st].tolist()
            self.edges[ids[st]] += [(b, c - 1, ids[row[b]]) for b, c in zip(starts, ends, strict=True) if row[b]]
            if dfa.accepts[st]:
                self.eps[ids[st]].append(e)
        return ids[1], e

    def node(self, op, av, dotall: bool, tail: bool = False) -> tuple[int, int]:
        if op is C.LITERAL:
            return self.literal_bytes(chr(av).encode())
        if op is C.NOT_LITERAL:
            return self.charset(_complement([(av, av)]))
        if op is C.ANY:
            return self.charset(_ALL if dotall else _complement([(10, 10)]))
        if op is C.IN:
            return self.charset(_class_ranges(av))
        if op is C.BRANCH:
            s, e = self.state(), self.state()
            for alt in av[1]:
                fs, fe = self.build(alt, dotall, tail)
                self.eps[s].append(fs)
                self.eps[fe].append(e)
            return s, e
        if op is C.SUBPATTERN:
            _group, add_flags, _del_flags, sub = av
            if add_flags & re.IGNORECASE:
                raise RegexError("case-insensitive groups (?i) are not supported")
            return self.build(sub, dotall or bool(add_flags & re.DOTALL), tail)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT) or op.name == "POSSESSIVE_REPEAT":
            lo, hi, sub = av
            return self.repeat(lo, hi, sub, dotall)
        if op is C.AT:
            if av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING):
                s = self.state()
                return s, s
            raise RegexError("word boundaries (\\b, \\B) are not supported")
        if getattr(op, "name", "") == "ATOMIC_GROUP":
            return self.build(av, dotall)
        if op in (C.ASSERT, C.ASSERT_NOT) and av[0] == 1:
            raise RegexError("a look-ahead is supported only where the rest of the text follows it "
                             "(at the top level, (?=...\\Z)X or (?!...\\Z)X)")
        names = {C.GROUPREF: "backreferences", C.ASSERT: "look-behind assertions",
                 C.ASSERT_NOT: "negative look-behind assertions", C.GROUPREF_EXISTS: "conditional groups"}
        raise RegexError(f"{names.get(op, str(op))} are not supported")

    def repeat(self, lo: int, hi: int, sub, dotall: bool) -> tuple[int, int]:
        s = cur = self.state()
        for _ in range(lo):
            fs, fe = self.build(sub, dotall)
            self.eps[cur].append(fs)
            cur = fe
        if hi is C.MAXREPEAT or hi == C.MAXREPEAT:
            fs, fe = self.build(sub, dotall)
            e = self.state()
            self.eps[cur] += [fs, e]
            self.eps[fe] += [fs, e]
            return s, e
        e = self.state()
        for _ in range(hi - lo):
            fs, fe = self.build(sub, dotall)
            self.eps[cur] += [fs, e]
            cur = fe
        self.eps[cur].append(e)
        return s, e


def _ends_at_end(items: list) -> bool:
    """Every match of ``items`` ends with ``\\Z``."""
    if not items:
        return False
    op, av = items[-1]
    if op is C.AT:
        return av == C.AT_END_STRING
    if op is C.BRANCH:
        return all(_ends_at_end(list(alt)) for alt in av[1])
    if op is C.SUBPATTERN:
        return _ends_at_end(list(av[3]))
    return False


def _class_ranges(items) -> list[tuple[int, int]]:
    negate = False
    ranges: list[tuple[int, int]] = []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY:
            ranges += _category(av)
        else:
            raise RegexError(f"unsupported item in a character class: {op}")
    ranges = _normalize(ranges)
    return _complement(ranges) if negate else ranges


# ---------------------------------------------------------------------------------------------
# DFA
# ---------------------------------------------------------------------------------------------


@dataclass
class DFA:
    """``table[state, byte]`` -> next state (0 = dead). ``accepts[state]``: the indices of the
    patterns that accept there, in pattern order. ``live[state]``: some byte leads on."""

    table: np.ndarray          # [num_states, 256] int32
    accepts: list[tuple[int, ...]]
    live: np.ndarray           # [num_states] bool

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def walk(self, state: int, data: bytes) -> int:
        t = self.table
        for b in data:
            state = int(t[state, b])
            if state == 0:
                return 0
        return state


def parse(pattern: str):
    """Parse ``pattern`` with the standard library parser; RegexError on bad syntax/flags."""
    try:
        sub = P.parse(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise RegexError(f"invalid regex {pattern!r}: {exc}") from None
    flags = sub.state.flags
    if flags & re.IGNORECASE:
        raise RegexError("case-insensitive matching (?i) is not supported")
    if flags & re.MULTILINE:
        raise RegexError("multi-line mode (?m) is not supported")
    return sub, bool(flags & re.DOTALL)


def compile_dfa(patterns: list[str]) -> DFA:
    """One DFA recognizing any of ``patterns`` (whole-text match), labelled by pattern."""
    nfa = _NFA()
    start = nfa.state()
    for i, pat in enumerate(patterns):
        if "(?=" in pat or "(?!" in pat:  # products are costly: build each such pattern once
            fs, fe = nfa.embed(_alone(pat))
        else:
            sub, dotall = parse(pat)
            fs, fe = nfa.build(sub, dotall, tail=True)
        nfa.eps[start].append(fs)
        nfa.accept[fe] = i
    return _determinize(nfa, start)


@functools.lru_cache(maxsize=512)
def _alone(pattern: str) -> DFA:
    """The DFA of one pattern (a pure function of the text, so memoized: a look-ahead
    terminal sits in many lexers of a grammar, and in many grammars)."""
    sub, dotall = parse(pattern)
    return _sub_dfa(list(sub), dotall)


def _sub_dfa(items: list, dotall: bool) -> DFA:
    nfa = _NFA()
    start = nfa.state()
    fs, fe = nfa.build(items, dotall, tail=True)
    nfa.eps[start].append(fs)
    nfa.accept[fe] = 0
    return _determinize(nfa, start)


def product(a: DFA, b: DFA, op: str) -> DFA:
    """The DFA of ``a`` and ``b`` (``op`` "and") or of ``a`` but not ``b`` ("minus"), trimmed:
    every state it keeps can still reach an accepting one (masks never lead into a trap)."""
    nb = b.num_states
    ids: dict[int, int] = {1 * nb + 1: 1}
    pairs = [(1, 1)]
    rows: list[np.ndarray] = []
    k = 0
    while k < len(pairs):
        x, y = pairs[k]
        ra, rb = a.table[x].astype(np.int64), b.table[y].astype(np.int64)
        keys = ra * nb + rb
        dead = (ra == 0) | ((rb == 0) if op == "and" else False)
        row = np.zeros(256, dtype=np.int32)
        for key in np.unique(keys[~dead]).tolist():
            sid = ids.get(key)
            if sid is None:
                if len(pairs) + 1 >= MAX_DFA_STATES:
                    raise RegexError(f"the pattern is too large (over {MAX_DFA_STATES} DFA states)")
                pairs.append(divmod(key, nb))
                sid = ids[key] = len(pairs)
            row[keys == key] = sid
        rows.append(row)
        k += 1
    table = np.zeros((len(pairs) + 1, 256), dtype=np.int32)
    table[1:] = np.array(rows)
    acc = [False] + [bool(a.accepts[x]) and (bool(b.accepts[y]) == (op == "and")) for x, y in pairs]
    return _trimmed(table, [(0,) if ok else () for ok in acc])


def _trimmed(table: np.ndarray, accepts: list[tuple[int, ...]]) -> DFA:
    """Cut the transitions into states from which no accepting state is reachable (an empty
    intersection, say), so that a live state always has a way to finish."""
    good = np.array([bool(a) for a in accepts])
    while True:
        more = good | good[table].any(axis=1)
        more[0] = False
        if (more == good).all():
            break
        good = more
    if not good.all():
        table = table.copy()
        table[~good[table]] = 0
        table[~good] = 0
    return DFA(table=table, accepts=accepts, live=(table != 0).any(axis=1))


def is_empty(pattern: str) -> bool:
    """Whether ``pattern`` matches no text at all."""
    dfa = compile_dfa([pattern])
    return not any(dfa.accepts)


def _determinize(nfa: _NFA, start: int) -> DFA:
    # Byte equivalence classes: bytes no edge tells apart.
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.add(lo)
            cuts.add(hi + 1)
    bounds = sorted(cuts)
    cls_of = np.zeros(256, dtype=np.int64)
    for k in range(len(bounds) - 1):
        cls_of[bounds[k]:bounds[k + 1]] = k
    ncls = len(bounds) - 1
    # NFA edges as (first class, last class, target)
    cedges = [[(int(cls_of[lo]), int(cls_of[hi]), t) for lo, hi, t in edges] for edges in nfa.edges]

    eps = nfa.eps
    closure_memo: dict[int, frozenset[int]] = {}

    def closure_of(states) -> frozenset[int]:
        seen = set()
        stack = list(states)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            memo = closure_memo.get(s)
            if memo is not None:
                seen |= memo
                continue
            stack.extend(eps[s])
        return frozenset(seen)

    init = closure_of([start])
    ids: dict[frozenset[int], int] = {init: 1}
    order = [init]
    rows: list[list[int]] = [[0] * ncls]  # the dead state's row
    k = 0
    while k < len(order):
        cur = order[k]
        targets: dict[int, set[int]] = {}
        for s in cur:
            for c0, c1, t in cedges[s]:
                for c in range(c0, c1 + 1):
                    targets.setdefault(c, set()).add(t)
        row = [0] * ncls
        groups: dict[frozenset[int], list[int]] = {}
        for c, ts in targets.items():
            groups.setdefault(frozenset(ts), []).append(c)
        for ts, cs in groups.items():
            clo = closure_of(ts)
            sid = ids.get(clo)
            if sid is None:
                if len(order) >= MAX_DFA_STATES:
                    raise RegexError(f"the pattern is too large (over {MAX_DFA_STATES} DFA states)")
                order.append(clo)
                sid = ids[clo] = len(order)
            for c in cs:
                row[c] = sid
        rows.append(row)
        k += 1
    table_cls = np.array(rows, dtype=np.int32)
    table = np.ascontiguousarray(table_cls[:, cls_of])
    accepts: list[tuple[int, ...]] = [()]
    for st in order:
        accepts.append(tuple(sorted({nfa.accept[s] for s in st if s in nfa.accept})))
    return _trimmed(table, accepts)
