"""The expressions a program adds to its state: text, chat-role blocks, ``gen``, ``select``.

``s += x`` queues ``x`` on the state; ``"a" + gen(...)`` builds a concatenation. Nothing here
talks to a back end: ``state.ProgramState`` executes expressions in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    def __add__(self, other: object) -> Concat:
        return Concat([self, as_expr(other)])

    def __radd__(self, other: object) -> Concat:
        return Concat([as_expr(other), self])


@dataclass
class Text(Expr):
    text: str


@dataclass
class Concat(Expr):
    parts: list[Expr]


@dataclass
class Role(Expr):
    """A chat turn: the model's chat template wraps ``content`` for ``role``."""

    role: str
    content: Expr | None
    part: str = "whole"  # "begin" / "end": only the template's text before / after a turn's content


@dataclass
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # native sampling parameters

    def describe(self) -> str:
        return f"gen({self.name!r})" if self.name else "gen()"


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]

    def describe(self) -> str:
        return f"select({self.name!r})" if self.name else "select()"


def as_expr(x: object) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(f"a program can add text (str) or radixd.lang expressions, not {type(x).__name__}")


def _role(role: str, content: object) -> Role:
    return Role(role, None if content is None else as_expr(content))


def role_begin(role: str) -> Role:
    """Open a ``role`` turn and leave it open (what follows is its content)."""
    return Role(role, None, "begin")


def role_end(role: str) -> Role:
    return Role(role, None, "end")


def assistant_begin() -> Role:
    return role_begin("assistant")


def assistant_end() -> Role:
    return role_end("assistant")


def system(content: object = None) -> Role:
    return _role("system", content)


def user(content: object = None) -> Role:
    return _role("user", content)


def assistant(content: object = None) -> Role:
    return _role("assistant", content)


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    *,
    top_p: float | None = None,
    top_k: int | None = None,
    min_tokens: int | None = None,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool | None = None,
    regex: str | None = None,
    json_schema: dict | str | None = None,
    ebnf: str | None = None,
) -> Gen:
    """Generate text at the end of the state; ``s[name]`` reads it. Constraints (``regex``,
    ``json_schema``, ``ebnf``) are sent as the server's native sampling parameters."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    opt = {"stop": stop, "temperature": temperature, "top_p": top_p, "top_k": top_k,
           "min_new_tokens": min_tokens, "seed": seed, "stop_token_ids": stop_token_ids,
           "ignore_eos": ignore_eos, "regex": regex, "ebnf": ebnf}
    params.update({k: v for k, v in opt.items() if v is not None})
    if json_schema is not None:
        import json

        params["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    return Gen(name, params)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Append the choice the model finds most likely (mean log-probability of its tokens
    after the state's text); ``s[name]`` reads it."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select() needs a non-empty list of strings as choices")
    return Select(name, list(choices))
