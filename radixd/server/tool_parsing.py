"""Tool-call markup in model output -> OpenAI's tool calls: the parser contract and the one
streaming state machine every format runs on.

Contract
--------
* A ``ToolParser`` (one per server, made by ``cls(template)`` from the ``radixd_tool_parsers``
  hook's table) describes one markup: ``run(stream)``, a generator that reads the output
  through ``CallStream``'s primitives, and ``form``, the ``CallForm`` that the grammars and the
  prompt for templates without tools are built from. It holds no per-request state.
* A ``CallStream`` is one choice's output, owned by the route that feeds it: ``feed(delta)``
  and a final ``flush()`` return OpenAI chat deltas (``{"content": ...}`` or ``{"tool_calls":
  [...]}``): a call's first delta carries its index, id, type and name (arguments ``""``),
  later ones argument fragments. Markup never reaches ``content``: text that may still turn
  into markup is held back until it cannot.
* ``parse(text)`` is the same machine fed the whole text at once, so a stream's deltas add up
  to exactly the non-streamed message, however the text is split.
* Malformed markup: until a call is committed (its name read and known, its arguments
  opening) everything from the opening marker on comes back as content text. After that the
  call stands with the arguments read so far (only a cut-off or unconstrained output gets
  there: under a tool grammar the markup cannot break).
* Whitespace next to a call is dropped; content is null when the output holds only calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

Delta = dict[str, Any]
Reader = Generator[None, None, Any]  # a primitive: suspends (yields) while it needs more text
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class CallForm:
    """How a format spells calls, as literal text around each call's arguments (a JSON object):
    ``prefix`` + (``begin(name)`` + arguments + ``end``) joined by ``sep`` + ``suffix``.
    ``trigger``: the text that opens a call in free text (a prefix of ``prefix`` + ``begin``)."""

    begin: str  # with "{name}" where the function's name goes
    end: str
    sep: str = ""
    prefix: str = ""
    suffix: str = ""
    trigger: str = ""

    def opening(self, name: str) -> str:
        return self.begin.replace("{name}", name)

    def spell(self, calls: Iterable[tuple[str, str]]) -> str:
        """(name, arguments JSON) pairs written in this markup (a history's assistant calls)."""
        body = self.sep.join(self.opening(n) + a + self.end for n, a in calls)
        return self.prefix + body + self.suffix


class ToolParser:
    """One tool-call markup. Subclasses set ``name``, ``markers`` (text of a chat template that
    picks this parser under ``model.tool_parser = "auto"``), ``form`` and ``run``;
    ``special_tokens``: the markup is made of special tokens, so outputs must keep them."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    special_tokens: ClassVar[bool] = False
    form: CallForm

    def __init__(self, template: str = ""):
        self.template = template

    @classmethod
    def detect(cls, template: str) -> bool:
        return any(m in template for m in cls.markers)

    def run(self, s: CallStream) -> Reader:
        raise NotImplementedError

    def history_id(self, call_id: str) -> str:
        """A call id as this format's templates take it back in a history."""
        return call_id

    def stream(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id) -> CallStream:
        return CallStream(self, names, new_id)

    def parse(self, text: str, names: Iterable[str] | None = None,
              new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool calls) of a whole output."""
        s = self.stream(names, new_id)
        return merge(s.feed(text) + s.flush())


def merge(deltas: list[Delta]) -> tuple[str | None, list[dict]]:
    """A stream's deltas added up: (content, tool calls in OpenAI's message shape)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": ""}})
            calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    return (content or None) if calls else content, calls


class JsonPrefix:
    """Checks text a character at a time: is it still the start of one JSON value?
    ``depth``: containers open; ``done``: a whole object or array has been read."""

    def __init__(self):
        self.stack: list[str] = []   # closing brackets expected
        self.want = "value"          # value | first | key | colon | next | first_item
        self.string: bool | None = None  # in a string: True a key, False a value
        self.escape = 0              # 1: after a backslash; 2..5: hex digits left + 1
        self.literal = ""            # rest of true/false/null
        self.number = ""             # state of a number being read
        self.done = False

    @property
    def depth(self) -> int:
        return len(self.stack)

    def push(self, c: str) -> bool:
        if self.done:
            return False
        if self.string is not None:
            return self._in_string(c)
        if self.literal:
            if c != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._after_value()
            return True
        if self.number:
            nxt = _NUMBER.get((self.number, "d" if c.isdigit() else c))
            if nxt is not None:
                self.number = nxt
                return True
            if self.number not in _NUMBER_ENDS:
                return False
            self.number = ""
            self._after_value()
            if self.done:  # (c is not part of the value)
                return False
        if c in " \t\n\r":
            return True
        w = self.want
        if w in ("value", "first_item"):
            if w == "first_item" and c == "]":
                return self._close(c)
            return self._value(c)
        if w in ("first", "key"):
            if w == "first" and c == "}":
                return self._close(c)
            if c == '"':
                self.string = True
                return True
            return False
        if w == "colon":
            if c == ":":
                self.want = "value"
                return True
            return False
        if c == ",":  # next
            self.want = "key" if self.stack[-1] == "}" else "value"
            return True
        return c in "}]" and self._close(c)

    def _value(self, c: str) -> bool:
        if c in "{[":
            self.stack.append("}" if c == "{" else "]")
            self.want = "first" if c == "{" else "first_item"
        elif c == '"':
            self.string = False
        elif c in "tfn":
            self.literal = {"t": "rue", "f": "alse", "n": "ull"}[c]
        elif c == "-" or c.isdigit():
            self.number = _NUMBER[("start", "d" if c.isdigit() else c)]
        else:
            return False
        return True

    def _in_string(self, c: str) -> bool:
        if self.escape == 1:
            if c == "u":
                self.escape = 5
            elif c in '"\\/bfnrt':
                self.escape = 0
            else:
                return False
        elif self.escape:
            if c not in "0123456789abcdefABCDEF":
                return False
            self.escape = 0 if self.escape == 2 else self.escape - 1
        elif c == "\\":
            self.escape = 1
        elif c == '"':
            key, self.string = self.string, None
            if key:
                self.want = "colon"
            else:
                self._after_value()
        elif ord(c) < 0x20:
            return False
        return True

    def _close(self, c: str) -> bool:
        if not self.stack or self.stack[-1] != c:
            return False
        self.stack.pop()
        self._after_value()
        return True

    def _after_value(self) -> None:
        if self.stack:
            self.want = "next"
        else:
            self.done = True


# a JSON number's states: (state, "d" for a digit or the character) -> next state
_NUMBER = {("start", "-"): "sign", ("start", "d"): "int", ("sign", "d"): "int", ("int", "d"): "int",
           ("int", "."): "dot", ("int", "e"): "e", ("int", "E"): "e", ("dot", "d"): "frac", ("frac", "d"): "frac",
           ("frac", "e"): "e", ("frac", "E"): "e", ("e", "+"): "esign", ("e", "-"): "esign", ("e", "d"): "exp",
           ("esign", "d"): "exp", ("exp", "d"): "exp"}
_NUMBER_ENDS = {"int", "frac", "exp"}  # (a leading zero followed by digits is let through)

HEADER_KEYS = ("arguments", "parameters")


class CallStream:
    """One output being read by a parser's ``run``; see the module's contract."""

    def __init__(self, parser: ToolParser, names: Iterable[str] | None, new_id: Callable[[], str]):
        self.names = None if names is None else frozenset(names)
        self._new_id = new_id
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.calls = 0
        self._out: list[Delta] = []
        self._ws = ""              # whitespace held back (dropped if a call follows)
        self._after_call = False   # drop whitespace until text comes
        self._run = parser.run(self)
        next(self._run, None)

    # ------------------------------------------------------------ driving

    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        self._resume()
        return self._take()

    def flush(self) -> list[Delta]:
        self.eof = True
        self._resume()
        if not self.calls and self._ws:
            self._out.append({"content": self._ws})
        self._ws = ""
        return self._take()

    def _resume(self) -> None:
        if self._run is not None:
            try:
                self._run.send(None)
            except StopIteration:
                self._run = None

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ output

    def text(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        both = self._ws + text
        body = both.rstrip()
        self._ws = both[len(body):]
        if body:
            if self._out and "content" in self._out[-1]:
                self._out[-1]["content"] += body
            else:
                self._out.append({"content": body})

    def as_text(self, start: int) -> None:
        """What was read from ``start`` to here is content after all."""
        self.text(self.buf[start:self.pos])

    def start_call(self, name: str) -> int:
        self._ws = ""
        self._after_call = True
        index = self.calls
        self.calls += 1
        self._out.append({"tool_calls": [{"index": index, "id": self._new_id(), "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        return index

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def known(self, name: str) -> bool:
        return bool(name) and (self.names is None or name in self.names)

    # ------------------------------------------------------------ reading primitives

    def need(self, n: int) -> Reader:
        """True once ``n`` characters are there to read (False: the output ended first)."""
        while len(self.buf) - self.pos < n:
            if self.eof:
                return False
            yield
        return True

    def peek(self) -> Reader:
        return self.buf[self.pos] if (yield from self.need(1)) else ""

    def skip_ws(self) -> Reader:
        while (yield from self.need(1)) and self.buf[self.pos].isspace():
            self.pos += 1

    def literal(self, text: str) -> Reader:
        """Read ``text`` if it comes next (else stay put and return False)."""
        for i, c in enumerate(text):
            if not (yield from self.need(i + 1)) or self.buf[self.pos + i] != c:
                return False
        self.pos += len(text)
        return True

    def word(self) -> Reader:
        start = self.pos
        while (yield from self.need(1)) and self.buf[self.pos] in NAME_CHARS:
            self.pos += 1
        return self.buf[start:self.pos]

    def text_until(self, markers: tuple[str, ...]) -> Reader:
        """Content up to the first of ``markers``; returns the marker (read) or None at the end."""
        while True:
            hits = [(i, m) for m in markers if (i := self.buf.find(m, self.pos)) >= 0]
            if hits:
                i, m = min(hits)
                self.text(self.buf[self.pos:i])
                self.pos = i + len(m)
                return m
            keep = _partial(self.buf, self.pos, markers) if not self.eof else 0
            self.text(self.buf[self.pos:len(self.buf) - keep])
            self.pos = len(self.buf) - keep
            if self.eof:
                return None
            yield

    def skip_past(self, marker: str) -> Reader:
        """Drop text through ``marker`` (or to the end): the rest of a broken call."""
        while (i := self.buf.find(marker, self.pos)) < 0:
            self.pos = max(self.pos, len(self.buf) - len(marker) + 1)
            if self.eof:
                self.pos = len(self.buf)
                return
            yield
        self.pos = i + len(marker)

    def json_value(self, index: int) -> Reader:
        """Call ``index``'s arguments, one JSON value at ``pos``, streamed as they come; True
        when whole, False when the text broke off (``pos`` there)."""
        p = JsonPrefix()
        sent = self.pos
        while not p.done:
            if self.pos == len(self.buf):
                self.arguments(index, self.buf[sent:self.pos])
                sent = self.pos
            if not (yield from self.need(1)) or not p.push(self.buf[self.pos]):
                break
            self.pos += 1
        self.arguments(index, self.buf[sent:self.pos])
        return p.done

    def call_object(self) -> Reader:
        """``{"name": ..., "arguments"|"parameters": {...}}`` at ``pos``: "call" (read),
        "text" (not a call: ``pos`` where it broke), "broken" (a committed call broke off).
        A name-first object commits when its arguments open and streams them; any other
        key order is read whole first."""
        start = self.pos
        p = JsonPrefix()
        index: int | None = None
        decided = streaming = False
        sent = start
        while not p.done:
            if streaming and self.pos == len(self.buf):
                self.arguments(index, self.buf[sent:self.pos])
                sent = self.pos
            if not (yield from self.need(1)) or not p.push(self.buf[self.pos]):
                break
            self.pos += 1
            if not decided and p.depth == 2:  # the first nested container just opened
                decided = True
                name = _header_name(self.buf[start:self.pos])
                if name is not None and self.known(name):
                    index, streaming, sent = self.start_call(name), True, self.pos - 1
            elif streaming and p.depth == 1:  # the arguments closed
                self.arguments(index, self.buf[sent:self.pos])
                streaming = False
        if index is not None:
            if streaming:
                self.arguments(index, self.buf[sent:self.pos])
            return "call" if p.done else "broken"
        if not p.done:
            return "text"
        obj = json.loads(self.buf[start:self.pos])
        name = obj.get("name") if isinstance(obj, dict) else None
        key = next((k for k in HEADER_KEYS if isinstance(obj, dict) and k in obj), None)
        args = obj.get(key) if key else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not (isinstance(name, str) and self.known(name) and isinstance(args, dict)):
            return "text"
        self.arguments(self.start_call(name), json.dumps(args, ensure_ascii=False))
        return "call"


def _header_name(head: str) -> str | None:
    """The name in ``{"name": "...", "arguments": {`` (the text up to the arguments' first
    bracket), else None."""
    try:
        obj = json.loads(head[:-1] + "0}")
    except json.JSONDecodeError:
        return None
    keys = list(obj)
    if len(keys) == 2 and keys[0] == "name" and keys[1] in HEADER_KEYS and isinstance(obj["name"], str) \
            and head.endswith("{"):
        return obj["name"]
    return None


def _partial(buf: str, pos: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``buf`` may be the start of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf) - pos), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best
