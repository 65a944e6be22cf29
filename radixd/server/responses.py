"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat pipeline.

The body becomes a chat completions body (``responses_protocol``), which runs through the
chat route's own internals (``openai_routes.start_chat``: template, tools, reasoning,
grammars, admission); what comes back, the ``chat.completion`` object or its chunks, is
reshaped here into a ``response`` object or Responses stream events. ``ResponseBuilder`` is
that reshaping, written once: the stream feeds it each chunk's delta, the non-streamed
route feeds it the whole message as one delta, so both give the same output items.

Contract: a builder is fed deltas in order (``reasoning_content``, then ``content``, then
``tool_calls``, as chat's stream sends them), then ``finish`` once; each call returns the
events it caused, numbered by ``sequence_number`` from 0. Output items: ``reasoning`` (from
``reasoning_content``), ``message`` (``output_text``), ``function_call`` (one per chat tool
call: ``call_id`` is the chat call's ``id``). A chat ``finish_reason`` of ``length`` makes the
response ``incomplete`` (``max_output_tokens``), ``abort`` makes it ``failed``; the stream's
last event is ``response.completed``, ``response.incomplete`` or ``response.failed``, with no
``[DONE]`` after it (OpenAI's stream has none).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd.server import protocol
from radixd.server.errors import ApiError
from radixd.server.openai_routes import start_chat
from radixd.server.responses_protocol import parse_responses, renamed
from radixd.server.sse import frame_json
from radixd.server.state import state_of

_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "failed"}
_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


async def create_response(request: Request) -> Response:
    st = state_of(request)
    req = parse_responses(await protocol.read_json(request))
    try:
        chat = protocol.parse_chat(req.chat, st.limits, st.model_name)
        call = await start_chat(st, request, chat, req.chat)
    except ApiError as exc:
        raise renamed(exc) from exc
    builder = ResponseBuilder(f"resp_{call.gen.rid}", st.model_name, settings(req.echo, chat.parsed.params),
                              st.engine.tokenizer)
    if not req.stream:
        result = await call.result()
        choice = result["choices"][0]
        builder.feed({**choice["message"], "tool_calls": [{**tc, "index": i} for i, tc in
                                                          enumerate(choice["message"].get("tool_calls") or [])]})
        builder.finish(choice["finish_reason"], result["usage"])
        return JSONResponse(builder.response())

    async def events():
        for event in builder.start():
            yield event
        reason = None
        async for chunk in call.chunks():
            for choice in chunk["choices"]:
                for event in builder.feed(choice["delta"]):
                    yield event
                reason = choice["finish_reason"] or reason
        for event in builder.finish(reason, call.gen.usage()):
            yield event

    return call.gen.stream(lambda: (sse(e) async for e in events()), done=False)


def sse(event: dict) -> bytes:
    """A Responses stream event framed as SSE: its type also on the ``event:`` line."""
    return frame_json(event, event["type"])


def settings(echo: dict[str, Any], params) -> dict[str, Any]:
    """The settings a Response repeats: the request's, with the sampling values in effect."""
    return {**echo, "temperature": params.temperature, "top_p": params.top_p, "store": False, "background": False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "truncation": "disabled",
            "max_tool_calls": None, "top_logprobs": 0, "service_tier": "default"}


class ResponseBuilder:
    """Chat deltas in, Responses output items and stream events out (see the module's contract)."""

    def __init__(self, rid: str, model: str, settings: dict[str, Any], tokenizer=None):
        self.id = rid
        self.created = int(time.time())
        self.model = model
        self.settings = settings
        self.tokenizer = tokenizer  # counts reasoning tokens when chat's usage does not
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None          # the item being generated (reasoning, message, or a call)
        self.calls: dict[int, dict] = {}       # chat tool-call index -> its function_call item
        self.status = "in_progress"
        self.usage: dict | None = None

    # ---------------------------------------------------------------- events

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def start(self) -> list[dict]:
        """The stream's first events: the response created, in progress."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, delta: dict) -> list[dict]:
        """A chat delta (or a whole chat message): the events of the text, reasoning and tool
        calls it adds."""
        events: list[dict] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for tc in delta.get("tool_calls") or []:
            events += self._call(tc)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._add(kind)
        item = self.open
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _add(self, kind: str) -> list[dict]:
        """Open a reasoning or message item and its one content part."""
        if kind == "message":
            item = {"id": self._item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": self._item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=_copy(part)))
        return events

    def _call(self, tc: dict) -> list[dict]:
        events = []
        fn = tc.get("function") or {}
        item = self.calls.get(tc.get("index", 0))
        if item is None:
            events += self._close()
            item = {"id": self._item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": tc.get("id") or self._item_id("call"), "name": fn.get("name") or "", "arguments": ""}
            self.calls[tc.get("index", 0)] = item
            self.output.append(item)
            self.open = item
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=_copy(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=fn["arguments"]))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        """Finish the open item: its done events, in OpenAI's order."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.output.index(item)
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", **where, text=part["text"], logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", **where, text=part["text"]))
            events.append(self._event("response.content_part.done", **where, part=_copy(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def finish(self, finish_reason: str | None, chat_usage: dict) -> list[dict]:
        """The last events: the open item done, then the response in its final state. Nothing
        generated at all still gives one (empty) message, as a non-streamed reply has."""
        self.status = _STATUS.get(finish_reason or "abort", "completed")
        item_status = "incomplete" if self.status == "incomplete" else "completed"
        events = [] if self.output else self._add("message")
        events += self._close(item_status)
        self.usage = self._usage(chat_usage)
        events.append(self._event(_LAST_EVENT[self.status], response=self.response()))
        return events

    # ---------------------------------------------------------------- the response object

    def _usage(self, chat: dict) -> dict:
        """Chat's usage in Responses' names; reasoning tokens: chat's count if it gives one,
        else the reasoning text's tokens."""
        details = chat.get("completion_tokens_details") or {}
        reasoning = details.get("reasoning_tokens")
        if reasoning is None:
            text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
            reasoning = len(self.tokenizer(text, add_special_tokens=False).input_ids) if text and self.tokenizer else 0
        cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": chat["total_tokens"]}

    def response(self) -> dict:
        """The ``response`` object as it stands."""
        done = self.status in ("completed", "incomplete", "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": self.status,
            "completed_at": int(time.time()) if self.status == "completed" else None,
            "error": {"code": "server_error", "message": "the generation was aborted"} if self.status == "failed"
            else None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "output": [_copy(i) for i in self.output] if done else [],
            "usage": self.usage,
            **self.settings,
        }


def _copy(value: Any) -> Any:
    """A snapshot of an item or part (events must not change when the builder goes on)."""
    return json.loads(json.dumps(value))
