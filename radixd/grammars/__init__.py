"""Structured generation: token masks from regexes, JSON Schemas and Lark grammars.

The contract every grammar backend (built-in or a plugin's, through the
``radixd_grammar_backends`` hook) fulfils::

    backend = Backend(engine_config, tokenizer=hf_tokenizer, vocab_size=V, eos_ids=(...))
    compiled = backend.compile(kind, spec)     # kind: "regex" | "json_schema" | "ebnf" (Lark)
                                               # | "structural_tag" (SGLang's; JSON text)
                                               # raises GrammarError (-> HTTP 400); runs in a
                                               # compile worker thread, never on the event loop
    m = compiled.matcher()                     # one per sequence (n > 1: one per sample)
    m.fill_mask(row)                           # row: numpy bool [V], True = allowed next
    m.accept_token(tok) -> bool                # after each sampled token (EOS included)
    m.is_terminated() -> bool                  # nothing but EOS may follow: finish now
    m.fill_mask_within(row, tokens_left)       # optional: the mask less the tokens after which
                                               # the document cannot be completed within
                                               # tokens_left - 1 more (the scheduler uses it
                                               # when present and [grammar]
                                               # close_within_max_tokens is on)
    m.fork() -> matcher | None                 # optional: a copy at the same position
                                               # (speculative drafts of a constrained
                                               # request are walked on one, then dropped)

``GrammarService`` (``service.py``) compiles off the loop with a time limit and keeps an LRU of
compiled grammars per (kind, spec, after) for the engine's tokenizer; ``after``
(``grammar_after``) wraps any backend's grammar so that it applies only from that text in the
output on (``triggers.AfterText``). A backend need not know every kind: one it lacks raises
``GrammarError``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

KINDS = ("regex", "json_schema", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; ``field`` is the request field to name in the 400."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


class GrammarMatcher(Protocol):
    def accept_token(self, token: int) -> bool: ...
    def fill_mask(self, out: np.ndarray) -> None: ...
    def is_terminated(self) -> bool: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, kind: str, spec: str) -> CompiledGrammar: ...
