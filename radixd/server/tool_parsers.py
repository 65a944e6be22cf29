"""The built-in tool-call parsers, registered through ``radixd_tool_parsers`` like any plugin.

* ``hermes``: Hermes 2 Pro, Qwen2.5, Qwen3 and the prompt radixd writes for templates
  without tools: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call.
* ``llama3_json``: Llama 3.1-3.3: ``{"name": ..., "parameters": {...}}`` at the start of the
  output (calls joined by ``;``), or after ``<|python_tag|>`` anywhere.
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` (one marker a call; ``[CALL_ID]id`` before ``[ARGS]`` read).
"""

from __future__ import annotations

from radixd.plugins import hookimpl
from radixd.server.tool_parsing import CallForm, CallStream, Reader, ToolParser


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    form = CallForm(begin='<tool_call>\n{"name": "{name}", "arguments": ', end="}\n</tool_call>", sep="\n",
                    trigger="<tool_call>")

    def run(self, s: CallStream) -> Reader:
        while True:
            marker = yield from s.text_until(("<tool_call>",))
            if marker is None:
                return
            region = s.pos - len(marker)
            yield from s.skip_ws()
            got = yield from s.call_object()
            if got == "text":
                s.as_text(region)
            elif got == "broken":
                yield from s.skip_past("</tool_call>")
            else:
                yield from s.skip_ws()
                yield from s.literal("</tool_call>")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    special_tokens = True
    form = CallForm(begin='{"name": "{name}", "parameters": ', end="}", sep="; ", trigger='{"name": ')

    def run(self, s: CallStream) -> Reader:
        start = s.pos
        yield from s.skip_ws()
        if (yield from s.peek()) == "{":
            yield from self._calls(s, s.pos)
        else:
            s.pos = start  # (the leading whitespace is content's)
        while True:
            marker = yield from s.text_until(("<|python_tag|>",))
            if marker is None:
                return
            yield from s.skip_ws()
            yield from self._calls(s, s.pos - len(marker))

    def _calls(self, s: CallStream, region: int) -> Reader:
        """Calls joined by ``;`` from ``pos``; a first one that is no call is text."""
        while True:
            got = yield from s.call_object()
            if got == "text":
                s.as_text(region)
            if got != "call":
                return
            yield from s.skip_ws()
            region = s.pos
            if not (yield from s.literal(";")):
                return
            yield from s.skip_ws()
            if (yield from s.peek()) != "{":
                return


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_tokens = True

    def __init__(self, template: str = ""):
        super().__init__(template)
        if "[ARGS]" in template:  # the newer tokenizers' form
            self.form = CallForm(begin="[TOOL_CALLS]{name}[ARGS]", end="", trigger="[TOOL_CALLS]")
        else:
            self.form = CallForm(begin='{"name": "{name}", "arguments": ', end="}", sep=", ", prefix="[TOOL_CALLS][",
                                 suffix="]", trigger="[TOOL_CALLS]")

    def history_id(self, call_id: str) -> str:
        """Mistral's templates take ids of exactly nine letters and digits."""
        return "".join(c for c in call_id if c.isalnum())[-9:].rjust(9, "0")

    def run(self, s: CallStream) -> Reader:
        while True:
            marker = yield from s.text_until(("[TOOL_CALLS]",))
            if marker is None:
                return
            region = s.pos - len(marker)
            yield from s.skip_ws()
            if (yield from s.literal("[")):
                yield from self._array(s, region)
                continue
            name = yield from s.word()
            if (yield from s.literal("[CALL_ID]")):
                yield from s.word()
            if not (s.known(name) and (yield from s.literal("[ARGS]"))):
                s.as_text(region)
                continue
            yield from s.skip_ws()
            yield from s.json_value(s.start_call(name))

    def _array(self, s: CallStream, region: int) -> Reader:
        while True:
            yield from s.skip_ws()
            got = yield from s.call_object()
            if got == "text":
                s.as_text(region)
            if got != "call":
                return
            yield from s.skip_ws()
            region = s.pos
            if (yield from s.literal("]")) or not (yield from s.literal(",")):
                return


@hookimpl
def radixd_tool_parsers():
    return {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
