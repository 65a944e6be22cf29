"""Per-request sampling parameters: each field's bounds declared once, checked on construction.

A numeric field's range lives in its metadata (``bounded``); ``__post_init__`` checks it and
``json_schema`` publishes it, so the HTTP layer's request tables (``radixd.server.protocol``,
``/openapi.json``) carry the same bounds as the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from radixd.core.errors import InvalidRequest

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
LOGIT_BIAS_MAX = 100.0


CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")  # grammar kinds, by their field


class Constraint(NamedTuple):
    kind: str          # one of CONSTRAINTS: the field that gave it (named in its errors)
    spec: str          # the grammar, as text
    after: str | None  # ``grammar_after``: the text from whose first occurrence on it applies


def bounded(default: Any, low: float, high: float | None = None, *, low_open: bool = False,
            nullable: bool = False) -> Any:
    """A numeric field allowed in [low, high] ((low, high] with ``low_open``; no upper bound
    without ``high``); an int ``low`` makes it an integer field. None is allowed when the
    default is None or ``nullable``."""
    return field(default=default, metadata={"min": low, "max": high, "low_open": low_open,
                                            "nullable": nullable or default is None})


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k. ``seed`` fixes
    the random stream of this request: the same seed and prompt give the same tokens whatever
    else shares the batch. ``stop`` holds stop strings (never emitted, not even in part);
    ``stop_token_ids`` end the request after emitting nothing for that token.
    ``max_new_tokens`` None: as many as fit in the context after the prompt (and in the KV
    pool), resolved by the engine when the call is checked.
    """

    max_new_tokens: int | None = bounded(128, 0, nullable=True)
    min_new_tokens: int = bounded(0, 0)
    # OpenAI's documented range (engines such as vLLM accept more; nothing useful lies there)
    temperature: float = bounded(1.0, 0.0, 2.0)
    top_p: float = bounded(1.0, 0.0, 1.0, low_open=True)
    top_k: int = bounded(-1, -1, INT32_MAX)  # batched into an int tensor
    min_p: float = bounded(0.0, 0.0, 1.0)
    repetition_penalty: float = bounded(1.0, 0.0, 10.0, low_open=True)
    frequency_penalty: float = bounded(0.0, -2.0, 2.0)
    presence_penalty: float = bounded(0.0, -2.0, 2.0)
    seed: int | None = bounded(None, 0, SEED_MAX)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # each in [0, INT32_MAX]
    ignore_eos: bool = False
    n: int = bounded(1, 1)
    logprobs: bool = False
    top_logprobs: int = bounded(0, 0)  # at most the engine's max_top_logprobs
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string that ended the text is kept
    # Added to the logits before picking (greedy or drawn), per token id: OpenAI's
    # ``logit_bias``, each bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]; ids checked against the
    # model's vocabulary when the engine takes the call.
    logit_bias: dict[int, float] | None = None
    # Return the log-probability of each prompt token from this position on (position 0 has
    # none); None = off. Cached KV before that position is reused, the rest is recomputed.
    prompt_logprobs_from: int | None = bounded(None, 0)
    # Structured generation: at most one of these (see radixd.grammars).
    regex: str | None = None
    json_schema: str | dict | bool | None = None  # a JSON Schema (object, or its JSON text)
    ebnf: str | None = None                       # a Lark grammar (LALR), start rule ``start``
    # SGLang's structural tag (object, or its JSON text): free text in which each trigger
    # opens a structure (the rest of its begin, JSON for its schema, its end); EOS only in
    # free text: {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}
    structural_tag: str | dict | None = None
    # The grammar above applies only from the first occurrence of this text in the output on
    # (before it: unconstrained), e.g. "</think>"; without a grammar it changes nothing.
    grammar_after: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for f in _BOUNDED:
            value = getattr(self, f.name)
            if value is not None or not f.metadata["nullable"]:
                _in_range(f.name, value, f.metadata)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                "min_new_tokens",
                f"{self.min_new_tokens} is larger than max_new_tokens ({self.max_new_tokens})",
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids", f"must be a list of integers in [0, {INT32_MAX}]")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos", "must be true or false")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest("logprobs", "must be true or false")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, "must be true or false")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.prompt_logprobs_from is not None and self.max_new_tokens == 0:
            raise InvalidRequest("max_new_tokens", "must be >= 1 when prompt_logprobs_from is set")
        given = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidRequest(given[1], f"give at most one constraint ({', '.join(CONSTRAINTS)}); "
                                           f"got {', '.join(given)}")
        for k in ("regex", "ebnf"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise InvalidRequest(k, "must be a string")
        if self.json_schema is not None and not isinstance(self.json_schema, str | dict | bool):
            raise InvalidRequest("json_schema", "must be a JSON Schema (an object) or its JSON text")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str | dict):
            raise InvalidRequest("structural_tag", "must be a structural tag (an object) or its JSON text")
        if self.grammar_after is not None and not (isinstance(self.grammar_after, str) and self.grammar_after):
            raise InvalidRequest("grammar_after", "must be a non-empty string")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise InvalidRequest("logit_bias", "must map token ids to biases")
        for tok, value in bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids (integers >= 0), got {tok!r}")
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) \
                    or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
                raise InvalidRequest("logit_bias", f"the bias of token {tok} must be a number in "
                                                   f"[{-LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> Constraint | None:
        """The grammar constraint, if any: its kind (the field's name), its spec as text (an
        object as JSON, keys in their given order: properties are generated in that order)
        and ``grammar_after``."""
        for kind in CONSTRAINTS:
            s = getattr(self, kind)
            if s is not None:
                return Constraint(kind, s if isinstance(s, str) else json.dumps(s), self.grammar_after)
        return None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


_BOUNDED = [f for f in fields(SamplingParams) if "min" in f.metadata]


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of the bounded field ``name`` (its type and range)."""
    meta = next(f.metadata for f in _BOUNDED if f.name == name)
    integer = isinstance(meta["min"], int)
    schema: dict[str, Any] = {"type": "integer" if integer else "number",
                              "exclusiveMinimum" if meta["low_open"] else "minimum": _plain(meta["min"])}
    if meta["max"] is not None:
        schema["maximum"] = _plain(meta["max"])
    return schema


def _plain(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _in_range(name: str, value: object, meta: dict) -> None:
    low, high = meta["min"], meta["max"]
    if isinstance(low, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(name, f"must be an integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidRequest(name, f"must be a number, got {value!r}")
    too_low = value <= low if meta["low_open"] else value < low
    if too_low or (high is not None and value > high):
        lo = f"> {low}" if meta["low_open"] else f">= {low}"
        hi = "" if high is None else f" and <= {high}"
        raise InvalidRequest(name, f"must be {lo}{hi}, got {value}")
