"""Reasoning output kept apart from the answer: ``<think>...</think>`` split out of chat replies.

    [model] reasoning_parser ("auto" | a name | "none")
      -> parsers from ``radixd_reasoning_parsers`` (built-ins: radixd.plugins.reasoning)
      -> ``ServerState.reasoning``: the parser this server uses, or None
    chat request -> ``ChatReasoning`` (the request's options; whether its output starts inside
       the reasoning, from what the template writes for the assistant's turn)
       -> a ``ReasoningSplitter`` per choice

``ReasoningSplitter`` is a per-choice state machine over the output text: ``feed(delta) ->
(reasoning_delta, content_delta)`` in output order, ``flush()`` at the end, or
``split(text)`` for a whole output; for any way of cutting a text into deltas the joined
results of ``feed`` + ``flush`` equal ``split``'s. Text that could still become a marker is
held back (never shown on the wrong side, never lost: ``flush`` gives it to the side it
was on). Only its owner (one choice's stream or reply) calls it. The request fields are
SGLang's ``separate_reasoning`` (false: no split, the raw text as content) and
``stream_reasoning`` (false: the reasoning in one delta, when it ends) and vLLM's
``include_reasoning`` (false: the reasoning dropped); replies carry it as
``reasoning_content`` (SGLang's, DeepSeek's, what most clients read) and ``reasoning``
(vLLM's current name). ``reasoning_end`` gives the marker after which a request's
grammars apply (``SamplingParams.grammar_after``): response formats here, tool grammars
in the tools' code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from radixd.core.errors import ConfigError
from radixd.core.sampling_params import SamplingParams
from radixd.plugins.wiring import provided
from radixd.server.errors import ApiError

SETTING = "model.reasoning_parser"
FIELDS = ("separate_reasoning", "stream_reasoning", "include_reasoning")  # the chat route's, null: true
SCHEMAS = {k: {"anyOf": [{"type": "boolean"}, {"type": "null"}]} for k in FIELDS}

_OPENING, _REASONING, _CONTENT = range(3)


def available(pm) -> dict[str, type]:
    """``{name: parser class}`` of every loaded plugin (a name two plugins give: ``ValueError``)."""
    return provided(pm.hook.radixd_reasoning_parsers, "reasoning parser")


def check_setting(name: str, table: dict[str, type]) -> None:
    """``ConfigError`` unless ``name`` is "auto", "none" or a loaded parser's name."""
    if name not in ("auto", "none") and name not in table:
        raise ConfigError(SETTING, name, "auto, none or one of " + ", ".join(sorted(table)))


def choose(name: str, table: dict[str, type], tokenizer):
    """The parser for ``[model] reasoning_parser`` (an instance), or None; "auto": the one whose
    ``detect`` knows the tokenizer's chat template (none: no reasoning parsing; several: name
    one)."""
    check_setting(name, table)
    if name == "auto":
        name = _detected(table, tokenizer)
    if name == "none":
        return None
    parser = table[name]()
    parser.name = name  # what /get_server_info reports, as SGLang's server arguments do
    return parser


def _detected(table: dict[str, type], tokenizer) -> str:
    """The one parser whose ``detect`` knows the tokenizer's chat template, else "none"."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return "none"
    opening = generation_prompt(tokenizer, {}) or ""
    found = sorted(n for n, cls in table.items() if cls.detect(template, opening))
    if len(found) > 1:
        raise ConfigError(SETTING, "auto", f"one name: the chat template fits {', '.join(found)}")
    return found[0] if found else "none"


class ReasoningSplitter:
    """One choice's output split into reasoning and content, as it arrives (module docstring).

    ``inside``: the output starts inside the reasoning. A leading ``start`` marker opens it
    (and is dropped) either way; ``end`` closes it (dropped); an implicit end closes it and
    stays in the content. After the reasoning everything is content."""

    def __init__(self, start: str, end: str, implicit_ends: tuple[str, ...] = (), *, inside: bool,
                 stream_reasoning: bool = True):
        self.start, self.end, self.implicit_ends = start, end, implicit_ends
        self.inside = inside
        self.stream_reasoning = stream_reasoning
        self._state = _OPENING
        self._held = ""      # text that may still turn out to be a marker
        self._withheld = ""  # reasoning kept for one delta (stream_reasoning false)

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content = ""
        while text:
            if self._state == _OPENING:
                if text.startswith(self.start):
                    text = text[len(self.start):]
                    self._state = _REASONING
                elif self.start.startswith(text):
                    self._held = text
                    break
                else:
                    self._state = _REASONING if self.inside else _CONTENT
            elif self._state == _REASONING:
                at, marker = self._first_end(text)
                if marker is None:
                    keep = self._partial_end(text)
                    reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                reasoning.append(text[:at])
                text = text[at + len(self.end):] if marker == self.end else text[at:]
                self._state = _CONTENT
            else:
                content, text = text, ""
        return self._shown("".join(reasoning)), content

    def flush(self) -> tuple[str, str]:
        """The held-back text, on the side it was on (the output ended)."""
        held, self._held = self._held, ""
        if self._state == _CONTENT or (self._state == _OPENING and not self.inside):
            return self._shown(""), held
        self._state = _CONTENT  # what is withheld comes out now
        return self._shown(held), ""

    def resume(self, text: str) -> None:
        """Take up where ``text`` (written before the output, not part of it) left off."""
        self.feed(text)
        self._held = self._withheld = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far leaves the output inside the reasoning."""
        return self._state == _REASONING or (self._state == _OPENING and self.inside)

    def split(self, text: str) -> tuple[str, str]:
        """A whole output (on a splitter not fed before): ``(reasoning, content)``."""
        r1, c1 = self.feed(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2

    def _shown(self, reasoning: str) -> str:
        if self.stream_reasoning:
            return reasoning
        self._withheld += reasoning
        if self._state != _CONTENT:
            return ""
        out, self._withheld = self._withheld, ""
        return out

    def _first_end(self, text: str) -> tuple[int, str | None]:
        best, marker = len(text), None
        for m in (self.end, *self.implicit_ends):
            at = text.find(m)
            if 0 <= at < best:
                best, marker = at, m
        return best, marker

    def _partial_end(self, text: str) -> int:
        """The length of the longest tail of ``text`` that starts an end marker."""
        keep = 0
        for m in (self.end, *self.implicit_ends):
            for n in range(min(len(m) - 1, len(text)), keep, -1):
                if text.endswith(m[:n]):
                    keep = n
                    break
        return keep


def for_chat(st, body: dict, req) -> ChatReasoning:
    """A chat request's reasoning handling (``st``: the ``ServerState``; ``req``: the parsed
    ``protocol.ChatRequest`` of ``body``)."""
    ex, last = req.parsed.extras, req.messages[-1]
    if ex.continue_final_message and last["role"] == "assistant":  # the continued text decides
        return ChatReasoning.of(st.reasoning, body, ex.template_kwargs, previous=last["content"])
    opening = None if st.reasoning is None else generation_prompt(st.engine.tokenizer, ex.template_kwargs)
    return ChatReasoning.of(st.reasoning, body, ex.template_kwargs, opening=opening)


def generation_prompt(tokenizer, template_kwargs: dict) -> str | None:
    """What the chat template writes for the assistant's turn (``add_generation_prompt``),
    rendered around a stand-in message; None when the template will not render one."""
    one = [{"role": "user", "content": "x"}]
    try:
        head = tokenizer.apply_chat_template(one, tokenize=False, add_generation_prompt=False, **template_kwargs)
        full = tokenizer.apply_chat_template(one, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception:  # a template that wants other messages: the parser's own rule decides
        return None
    return full[len(head):] if full.startswith(head) else None


def starts_inside(parser, opening: str | None, template_kwargs: dict) -> bool:
    """Whether the output starts inside the reasoning: the template opened a block in the
    assistant's turn (R1, Qwen3.5, Qwen3's thinking releases), closed one (Qwen3 with
    ``enable_thinking: false``, DeepSeek-V3.1 without ``thinking``), or, writing neither
    marker, left it to the parser's ``thinks``."""
    opened = -1 if opening is None else opening.rfind(parser.start)
    closed = -1 if opening is None else opening.rfind(parser.end)
    if opened < 0 and closed < 0:
        return bool(parser.thinks(template_kwargs))
    return opened > closed


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return value


@dataclass
class ChatReasoning:
    """One chat request's reasoning handling (``parser`` None: none, all output is content).

    ``inside``: the output starts inside the reasoning (``starts_inside``); ``previous``: with
    ``continue_final_message``, the assistant text the output continues (where it left off
    decides, as in SGLang)."""

    parser: Any = None
    inside: bool = False
    stream_reasoning: bool = True
    include: bool = True
    previous: str = ""

    def __post_init__(self) -> None:
        self._splitters: dict[int, ReasoningSplitter] = {}

    @classmethod
    def of(cls, parser, body: dict, template_kwargs: dict, *, opening: str | None = None,
           previous: str = "") -> ChatReasoning:
        """The request's handling from its body's fields (``FIELDS``; null: the default);
        ``opening``: the template's ``generation_prompt`` for it (None: unknown)."""
        separate, stream, include = (_flag(body, k) for k in FIELDS)
        if parser is None or not separate:
            return cls()
        return cls(parser, starts_inside(parser, opening, template_kwargs), stream, include, previous)

    @property
    def thinks(self) -> bool:
        return self.parser is not None and self._splitter().in_reasoning

    def reasoning_end(self) -> str | None:
        """The marker after which the request's grammars apply (None: from the start)."""
        return self.parser.end if self.thinks else None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its grammar (if any) starting after the reasoning."""
        end = self.reasoning_end()
        if end is None or params.constraint is None:
            return params
        return replace(params, grammar_after=end)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply: ``(reasoning or None, content)``."""
        if self.parser is None:
            return None, text
        reasoning, content = self._splitter().split(text)
        return reasoning or None, content

    def feed(self, index: int, delta: str, finished: bool) -> tuple[str, str]:
        """One stream update of choice ``index``: ``(reasoning_delta, content_delta)``."""
        if self.parser is None:
            return "", delta
        s = self._splitters.get(index)
        if s is None:
            s = self._splitters[index] = self._splitter()
        reasoning, content = s.feed(delta)
        if finished:
            r, c = s.flush()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def fields(self, reasoning: str | None) -> dict[str, str | None]:
        """The reply's or delta's reasoning fields (none without a parser or when excluded)."""
        if self.parser is None or not self.include:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def message(self, text: str) -> dict[str, Any]:
        """An assistant message's ``content`` and reasoning fields for a whole reply (content
        null when the reply was all reasoning, as SGLang and vLLM send it)."""
        reasoning, content = self.split(text)
        return {"content": content or (None if reasoning else content), **self.fields(reasoning)}

    def delta(self, index: int, text: str, finished: bool) -> dict[str, str]:
        """A stream chunk's ``delta`` fields for choice ``index``'s new text."""
        reasoning, content = self.feed(index, text, finished)
        out = self.fields(reasoning) if reasoning else {}
        return {**out, "content": content} if content else out

    def _splitter(self) -> ReasoningSplitter:
        p = self.parser
        s = ReasoningSplitter(p.start, p.end, tuple(p.implicit_ends), inside=self.inside,
                              stream_reasoning=self.stream_reasoning)
        if self.previous:
            s.resume(self.previous)
        return s
