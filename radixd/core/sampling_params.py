"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from radixd.core.errors import InvalidRequest

INT32_MAX = 2**31 - 1

@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k. ``seed`` fixes
    the random stream of this request: the same seed and prompt give the same tokens whatever
    else shares the batch. ``stop`` holds stop strings (never emitted, not even in part);
    ``stop_token_ids`` end the request after emitting nothing for that token.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # Return the log-probability of each prompt token from this position on (position 0 has
    # none); None = off. Cached KV before that position is reused, the rest is recomputed.
    prompt_logprobs_from: int | None = None
    # Structured generation: at most one of these (see radixd.grammars).
    regex: str | None = None
    json_schema: str | dict | bool | None = None  # a JSON Schema (object, or its JSON text)
    ebnf: str | None = None                       # a Lark grammar (LALR), start rule ``start``

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        _int_range("max_new_tokens", self.max_new_tokens, 0, None)
        _int_range("min_new_tokens", self.min_new_tokens, 0, None)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                "min_new_tokens",
                f"{self.min_new_tokens} is larger than max_new_tokens ({self.max_new_tokens})",
            )
        _float_range("temperature", self.temperature, 0.0, 100.0)
        _float_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_range("top_k", self.top_k, -1, INT32_MAX)  # batched into an int tensor
        _float_range("min_p", self.min_p, 0.0, 1.0)
        _float_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.seed is not None:
            _int_range("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids", f"must be a list of integers in [0, {INT32_MAX}]")
        _int_range("n", self.n, 1, None)
        _int_range("top_logprobs", self.top_logprobs, 0, None)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest("ignore_eos", "must be true or false")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest("logprobs", "must be true or false")
        if not isinstance(self.skip_special_tokens, bool):
            raise InvalidRequest("skip_special_tokens", "must be true or false")
        if self.prompt_logprobs_from is not None:
            _int_range("prompt_logprobs_from", self.prompt_logprobs_from, 0, None)
            if self.max_new_tokens == 0:
                raise InvalidRequest("max_new_tokens", "must be >= 1 when prompt_logprobs_from is set")
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise InvalidRequest(given[1], f"give at most one constraint (regex, json_schema, ebnf); got {', '.join(given)}")
        for k in ("regex", "ebnf"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise InvalidRequest(k, "must be a string")
        if self.json_schema is not None and not isinstance(self.json_schema, str | dict | bool):
            raise InvalidRequest("json_schema", "must be a JSON Schema (an object) or its JSON text")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec text) of the grammar constraint, if any; a schema object as JSON text
        (keys in their given order: properties are generated in that order)."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        if self.json_schema is not None:
            s = self.json_schema
            return ("json_schema", s if isinstance(s, str) else json.dumps(s))
        return None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _int_range(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        hi = "" if high is None else f" and <= {high}"
        raise InvalidRequest(name, f"must be >= {low}{hi}, got {value}")


def _float_range(
    name: str, value: object, low: float, high: float, *, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidRequest(name, f"must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        lo = f"> {low}" if low_open else f">= {low}"
        raise InvalidRequest(name, f"must be {lo} and <= {high}, got {value}")
