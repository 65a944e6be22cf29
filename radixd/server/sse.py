"""Server-sent events: the framing and the streaming response of the generation routes.

    route's events (SSE bytes) -> SSEResponse (one body message per batch of ready events)
        -> the Gate's send -> hypercorn -> socket

The framing is sse-starlette's (``ServerSentEvent``: ``\\r\\n`` line ends, one ``data:`` line
per line of the payload, a blank line after each event); the hot paths (a one-line JSON chunk,
``[DONE]``) write its bytes directly, so that a route frames an event straight into bytes.
``Framing`` turns a route's payloads into events; ``Framing.text`` renders the stream's common chunk, one that differs from the others of its
kind only by its text, from a template that ``json.dumps`` itself made, so that it is the
same bytes as ``json.dumps`` of the whole chunk at a fraction of the cost.

``SSEResponse`` does what the routes relied on sse-starlette's ``EventSourceResponse`` for,
with one task and no cancel scope per event: the events are written as they come; a keep-alive
comment every ``ping_s`` seconds when asked; a client that disconnects ends the stream (the
events' generator gets ``CancelledError`` where it waits); a failed write closes the events'
generator before the error leaves; the body is ended once the events are. When the events
come faster than they are written (the loop is behind, or the client's socket is full), the
ones ready together leave in one write: ``ready()`` says whether the source holds more
without waiting, and the source calls ``flush()`` before it waits, so that no event is held
back behind a wait. The bytes on the wire are the same as written one by one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from sse_starlette.sse import ServerSentEvent
from starlette.responses import Response

_text = json.encoder.encode_basestring_ascii  # what json.dumps writes a str as (ensure_ascii)


def frame(data: str, event: str | None = None) -> bytes:
    """One event: an ``event:`` line if ``event``, a ``data:`` line per line of ``data``
    (sse-starlette's ``ServerSentEvent``; the hot paths below write the same bytes directly)."""
    return ServerSentEvent(data=data, event=event).encode()


def frame_json(payload, event: str | None = None) -> bytes:
    """``payload`` as compact JSON in one event (a JSON text has no line breaks)."""
    data = json.dumps(payload, separators=(",", ":"))
    if event is None:
        return b"data: " + data.encode() + b"\r\n\r\n"
    return frame(data, event)


DONE = frame("[DONE]")
MARK = "\x00radixd-text\x00"  # where a template's text goes (no generated text is this string)


class Framing:
    """A stream's payloads -> SSE events. ``extra()`` (if given) adds fields to every payload
    at the time it is framed (vLLM's usage in every chunk).

    ``text(build, key, text)`` is ``self(build(key, text))``: ``build`` (one function per
    ``Framing``) makes the payload of a chunk whose only part that changes between the chunks
    of one ``key`` is ``text``. The first call per ``key`` frames ``build(key, MARK)`` with
    ``json.dumps`` and keeps the bytes on both sides of the marker; the others only encode
    their text between them."""

    def __init__(self, extra: Callable[[], dict] | None = None):
        self.extra = extra
        self._templates: dict = {}

    def __call__(self, payload: dict) -> bytes:
        if self.extra is not None:
            payload = {**payload, **self.extra()}
        return frame_json(payload)

    def text(self, build: Callable[[int, str], dict], key: int, text: str) -> bytes:
        if self.extra is not None:  # the extra fields change with every chunk
            return self(build(key, text))
        parts = self._templates.get(key)
        if parts is None:
            whole = self(build(key, MARK)).decode()
            head, mark, tail = whole.partition(_text(MARK))
            if not mark or _text(MARK) in tail:  # the text is not a plain field: no template
                return self(build(key, text))
            parts = self._templates[key] = (head, tail)
        return (parts[0] + _text(text) + parts[1]).encode()


class SSEResponse(Response):
    """``events`` (SSE bytes; a ``{"data", "event"}`` dict is framed here), then ``end``, as a
    ``text/event-stream`` response, as described in the module docstring. ``ready``: whether
    the events' source holds another event without waiting (None: never assumed).
    ``closed(gone)`` runs once when the events end, before the body is closed: ``gone`` when
    the client left (a disconnect, a failed or cancelled write), not when the events raised."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes | dict], ping_s: float = 0.0, *, end: bytes = b"",
                 ready: Callable[[], bool] | None = None, closed: Callable[[bool], None] | None = None):
        self.body_iterator = events
        self.status_code = 200
        self.background = None
        self.ping_s = ping_s
        self.end = end
        self.ready = ready
        self.init_headers({"cache-control": "no-store", "connection": "keep-alive", "x-accel-buffering": "no"})
        self._closed = closed
        self._held: list[bytes] = []
        self._send = None
        self._open = True  # until the closing body is sent: no keep-alive after it
        self._write_failed = False
        self.writes = 0  # body messages sent (events written together count once)

    async def __call__(self, scope, receive, send) -> None:
        self._send = send
        tasks = [asyncio.ensure_future(self._stream(send)), asyncio.ensure_future(_until_disconnect(receive))]
        if self.ping_s > 0:
            tasks.append(asyncio.ensure_future(self._ping(send)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
            await self.body_iterator.aclose()  # if a cancelled write left it at a yield
            self._close(True)  # if the stream was cancelled before it started
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def flush(self) -> None:
        """Write the events held back, if any, in one body message."""
        held = self._held
        if held:
            body = held[0] if len(held) == 1 else b"".join(held)
            held.clear()
            self.writes += 1
            try:
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
            except BaseException:
                self._write_failed = True
                raise

    def _close(self, gone: bool) -> None:
        closed, self._closed = self._closed, None
        if closed is not None:
            closed(gone)

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ready = self.ready
        held = self._held
        try:
            async for event in self.body_iterator:
                held.append(event if isinstance(event, bytes) else frame(**event))
                if ready is None or not ready():
                    await self.flush()
            if self.end:
                held.append(self.end)
            await self.flush()
        except BaseException as exc:
            # a write failed or was cancelled with the events suspended at a yield: their
            # clean-up runs now, before the error goes on
            await self.body_iterator.aclose()
            self._close(self._write_failed or isinstance(exc, asyncio.CancelledError))
            raise
        self._close(False)
        self._open = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _ping(self, send) -> None:
        while True:
            await asyncio.sleep(self.ping_s)
            if not self._open:
                return
            await send({"type": "http.response.body", "more_body": True,
                        "body": ServerSentEvent(comment=f"ping - {datetime.now(UTC)}").encode()})


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
