"""xgrammar as a radixd grammar backend (``[grammar] backend = "xgrammar"``)."""

from __future__ import annotations

import json
import threading

import numpy as np

from radixd.grammars import GrammarError
from radixd.plugins import hookimpl


class XGrammarMatcher:
    """One sequence: xgrammar's matcher, its token bitmask unpacked into radixd's bool rows."""

    __slots__ = ("m", "bits", "vocab_size", "stop_ids")

    def __init__(self, compiled, vocab_size: int, stop_ids: list[int]):
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.bits = xgr.allocate_token_bitmask(1, vocab_size)

    def fill_mask(self, out: np.ndarray) -> None:
        if self.m.is_terminated():  # xgrammar has no mask after its stop token
            out[:] = False
            out[self.stop_ids] = True
            return
        self.m.fill_next_token_bitmask(self.bits, 0)
        packed = self.bits.numpy().view(np.uint8)[0]
        out[:] = np.unpackbits(packed, bitorder="little")[: self.vocab_size].view(bool)

    def accept_token(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


class XGrammarCompiled:
    def __init__(self, compiled, vocab_size: int, stop_ids: list[int]):
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self.vocab_size, self.stop_ids)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, config, *, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.max_ws = getattr(config, "grammar_max_whitespace", 2)
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def compiler(self):
        import xgrammar as xgr

        with self._lock:  # built once, in a compile worker
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, kind: str, spec: str) -> XGrammarCompiled:
        if kind == "ebnf":
            raise GrammarError("ebnf", "the xgrammar backend does not read Lark grammars; use the radixd backend")
        try:
            if kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "json_schema":
                try:
                    json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise GrammarError("json_schema", f"the schema is not valid JSON: {exc}") from None
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=self.max_ws > 0,
                                                             max_whitespace_cnt=self.max_ws or None)
            else:
                raise GrammarError(kind, f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its message
            raise GrammarError(kind, f"xgrammar: {exc}") from None
        return XGrammarCompiled(compiled, self.vocab_size, self.eos_ids)


@hookimpl
def radixd_grammar_backends():
    return {"xgrammar": XGrammarBackend}
