"""Lark grammars (LALR) -> ``TokenGrammar``: Lark builds the parse table, radixd lexes bytes."""

from __future__ import annotations

import re

from radixd.grammars.automaton import TokenGrammar
from radixd.grammars.lexers import Terminal
from radixd.grammars.parsers import LalrParser
from radixd.grammars.regex_dfa import RegexError, parse
from radixd.grammars.vocab import TokenizerInfo

# Lark's common.lark writes ESCAPED_STRING with a look-behind; this is the same language.
_REPLACEMENTS = {"ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"', "_STRING_ESC_INNER": r'(?:[^"\\]|\\.)*'}


class GrammarSyntaxError(ValueError):
    """The grammar text does not compile (the message says where and why)."""


def _terminal_regex(term) -> str:
    pat = term.pattern
    flags = set(getattr(pat, "flags", ()) or ())
    if pat.type == "str":
        text = pat.value
        if "i" in flags:  # case-insensitive literal: one class per letter
            return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in text)
        return re.escape(text)
    rx = pat.value
    if term.name in _REPLACEMENTS and "(?<" in rx:
        return _REPLACEMENTS[term.name]
    unsupported = flags - {"s", "x"}
    if unsupported:
        raise GrammarSyntaxError(f"terminal {term.name}: regex flag(s) {''.join(sorted(unsupported))} are not supported")
    if "s" in flags:
        rx = "(?s:" + rx + ")"
    return rx


def compile_lark(text: str, vocab: TokenizerInfo, *, start: str = "start", mask_cache_size: int = 1024,
                 shared=None, warm_budget_s: float = 0.1, tight: frozenset[str] = frozenset()) -> TokenGrammar:
    """``tight``: names of terminals that the ignored ones (``%ignore``) may not precede."""
    from lark import Lark
    from lark.exceptions import LarkError

    try:
        lk = Lark(text, parser="lalr", lexer="contextual", start=start)
    except LarkError as exc:
        raise GrammarSyntaxError(f"the grammar does not compile: {exc}".strip()) from None
    terminals, ids = [], {}
    for t in lk.terminals:
        rx = _terminal_regex(t)
        try:
            parse(rx)
        except RegexError as exc:
            raise GrammarSyntaxError(f"terminal {t.name}: {exc}") from None
        ids[t.name] = len(terminals)
        terminals.append(Terminal(t.name, rx, t.priority, t.pattern.type == "str"))
    parse_table = lk.parser.parser.parser.parse_table
    parser = LalrParser(parse_table, ids, end_id=len(terminals), start=start)
    ignore = frozenset(ids[n] for n in lk.ignore_tokens if n in ids)
    g = TokenGrammar(terminals, parser, vocab, ignore, mask_cache_size=mask_cache_size, shared=shared,
                     tight=frozenset(ids[n] for n in tight))
    g.warm(warm_budget_s)
    return g
