"""radixd's own grammar backend, registered through ``radixd_grammar_backends`` like any plugin."""

from __future__ import annotations

import threading

from radixd.grammars import GrammarError
from radixd.grammars.automaton import TokenGrammar
from radixd.grammars.budget import Budget, ClosingMatcher, ClosingShared
from radixd.grammars.json_schema import SchemaError, schema_to_lark
from radixd.grammars.lark_grammar import GrammarSyntaxError, compile_lark
from radixd.grammars.lexers import SharedLexers, Terminal
from radixd.grammars.parsers import SingleTerminalParser
from radixd.grammars.regex_dfa import RegexError, parse
from radixd.grammars.structural_tag import StructuralTag, compile_structural_tag
from radixd.grammars.vocab import TokenizerInfo
from radixd.plugins import hookimpl


class RadixdCompiled:
    def __init__(self, grammar: TokenGrammar, closing: ClosingShared, warm: bool = True):
        self.grammar = grammar
        self.budget = Budget(grammar, closing)
        if warm:  # (the scheduler uses the budget only with [grammar] close_within_max_tokens)
            self.budget.warm()

    def matcher(self) -> ClosingMatcher:
        return ClosingMatcher(self.grammar, self.budget)


class RadixdBackend:
    """Regex, JSON Schema, Lark (LALR) and structural-tag constraints: byte-level DFAs per lexer state,
    masks computed vectorized over the vocabulary the first time a configuration is reached."""

    name = "radixd"

    def __init__(self, config, *, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_ids)
        self._vocab: TokenizerInfo | None = None
        self._closing: ClosingShared | None = None
        self._lock = threading.Lock()
        self.max_ws = getattr(config, "grammar_max_whitespace", 2)
        self.mask_cache_size = getattr(config, "grammar_mask_cache_size", 1024)
        self.close_within_max_tokens = getattr(config, "grammar_close_within_max_tokens", True)
        self.warm_budget_s = getattr(config, "grammar_warm_budget_ms", 100) / 1000
        self.shared = SharedLexers()  # lexers and vocabulary scans common to all grammars

    @property
    def vocab(self) -> TokenizerInfo:
        with self._lock:  # built once, in a compile worker (off the event loop)
            if self._vocab is None:
                self._vocab = TokenizerInfo.from_tokenizer(self._tokenizer, self._vocab_size, self._eos)
            return self._vocab

    @property
    def closing(self) -> ClosingShared:
        vocab = self.vocab
        with self._lock:
            if self._closing is None:
                self._closing = ClosingShared(vocab)
            return self._closing

    @property
    def tokenizer_key(self) -> str:
        return self.vocab.key

    def compile(self, kind: str, spec: str) -> RadixdCompiled | StructuralTag:
        vocab = self.vocab
        try:
            if kind == "regex":
                parse(spec)
                g = TokenGrammar([Terminal("REGEX", spec)], SingleTerminalParser(), vocab,
                                 mask_cache_size=self.mask_cache_size, shared=self.shared)
                g.warm(self.warm_budget_s)
            elif kind == "json_schema":
                g = compile_lark(schema_to_lark(spec, self.max_ws), vocab, mask_cache_size=self.mask_cache_size,
                                 shared=self.shared, warm_budget_s=self.warm_budget_s)
            elif kind == "structural_tag":
                return compile_structural_tag(spec, vocab, max_ws=self.max_ws, mask_cache_size=self.mask_cache_size,
                                              shared=self.shared, warm_budget_s=self.warm_budget_s)
            elif kind == "ebnf":
                g = compile_lark(spec, vocab, mask_cache_size=self.mask_cache_size, shared=self.shared,
                                 warm_budget_s=self.warm_budget_s)
            else:
                raise GrammarError(kind, f"unknown grammar kind {kind!r}")
        except SchemaError as exc:
            raise GrammarError("json_schema", f"unsupported JSON Schema keyword '{exc.keyword}': {exc}") from None
        except RegexError as exc:
            raise GrammarError(kind, str(exc)) from None
        except GrammarSyntaxError as exc:
            if kind == "json_schema":  # e.g. anyOf branches LALR(1) cannot tell apart
                raise GrammarError(kind, f"the schema's grammar is not LALR(1): {exc}") from None
            raise GrammarError(kind, str(exc)) from None
        return RadixdCompiled(g, self.closing, self.close_within_max_tokens)


@hookimpl
def radixd_grammar_backends():
    return {"radixd": RadixdBackend}
