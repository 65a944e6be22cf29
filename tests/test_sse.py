"""The SSE path without a model: the framing against ``json.dumps``, ``SSEResponse`` (events
written together when ready, nothing held back behind a wait, disconnects, the closing body),
``Generation.outputs`` flushing before it waits, and the Gate's per-response write deadline."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from radixd.server.gate import ClientTooSlow, SendDeadline
from radixd.server.generation import Generation
from radixd.server.sse import DONE, Framing, SSEResponse, frame, frame_json

SCOPE = {"type": "http", "method": "POST", "path": "/", "headers": []}


def compact(payload) -> bytes:  # what the routes framed before: json.dumps, sse-starlette's framing
    return f"data: {json.dumps(payload, separators=(',', ':'))}\r\n\r\n".encode()


TEXTS = ["", "plain", 'quote " and \\ backslash', "new\nline\r\n", "caf\u00e9 \u4e2d\u6587 \U0001F600", "\x00\x1f\x7f",
         "\u2028\u2029", "data: [DONE]", "\ud800"]


@pytest.mark.parametrize("text", TEXTS)
def test_text_chunks_are_json_dumps_bytes(text):
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}

    def chunk(index: int, t: str) -> dict:
        return {**base, "choices": [{"index": index, "text": t, "logprobs": None, "finish_reason": None}]}

    framing = Framing()
    for index in (0, 3, 0):  # a template per index, made on first use, then reused
        assert framing.text(chunk, index, text) == compact(chunk(index, text))
    usage = {"prompt_tokens": 1}
    with_usage = Framing(lambda: {"usage": usage})  # every chunk differs: no template
    assert with_usage.text(chunk, 0, text) == compact({**chunk(0, text), "usage": usage})


def test_framing_matches_sse_starlette():
    from sse_starlette.sse import ServerSentEvent

    for data, event in (('{"a":"\\u00e9"}', None), ('{"type":"x"}', "x"), ("[DONE]", None)):
        assert frame(data, event) == ServerSentEvent(data=data, event=event).encode()
    assert frame_json({"a": "\u00e9"}) == ServerSentEvent(data='{"a":"\\u00e9"}').encode()
    assert frame_json({"a": "\u00e9"}) == compact({"a": "\u00e9"})
    assert frame("a\nb\r\nc", "evt") == b"event: evt\r\ndata: a\r\ndata: b\r\ndata: c\r\n\r\n"
    assert frame_json({"type": "x"}, "x") == b'event: x\r\ndata: {"type":"x"}\r\n\r\n'
    assert DONE == b"data: [DONE]\r\n\r\n"


async def never_disconnect():
    await asyncio.Event().wait()


def stream(events: list[bytes], ready) -> tuple[list[dict], SSEResponse]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def source():
        for e in events:
            yield e

    response = SSEResponse(source(), end=DONE, ready=ready)
    asyncio.run(response(SCOPE, never_disconnect, send))
    return sent, response


def test_ready_events_leave_in_one_write_with_the_same_bytes():
    events = [frame_json({"i": i, "text": "x" * i}) for i in range(6)]
    one_by_one, r1 = stream(events, None)
    together, r2 = stream(events, lambda: True)
    bodies = [[m["body"] for m in sent if m["type"] == "http.response.body"] for sent in (one_by_one, together)]
    assert b"".join(bodies[0]) == b"".join(bodies[1]) == b"".join(events) + DONE
    assert (r1.writes, r2.writes) == (len(events) + 1, 1)
    for sent in (one_by_one, together):
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert all(m["more_body"] for m in sent[1:-1])


class FakeSub:
    """What ``Generation.outputs`` reads of a ``Submission``."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def ready(self) -> bool:
        return not self.queue.empty()

    async def __anext__(self):
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        self.closed = True


class FakeTracker:
    info: dict = {}

    def see(self, out, i=0):
        pass

    def done(self):
        self.reported = True


def test_held_events_are_written_before_the_source_waits():
    """Two outputs ready at once, the second making no event (a parser holding text back),
    then a wait: the first one's event must not wait with it."""

    async def run():
        sub = FakeSub()
        gen = Generation.__new__(Generation)
        gen.subs, gen.tracker, gen.leg, gen._stream = [sub], FakeTracker(), None, None
        written: list[bytes] = []

        async def send(message):
            written.append(message.get("body", b""))

        async def events():
            async for _, out in gen.outputs():
                if out != "held back":
                    yield frame(out)

        gen._stream = SSEResponse(events(), end=DONE, ready=gen.ready)
        sub.queue.put_nowait("a")
        sub.queue.put_nowait("held back")
        task = asyncio.ensure_future(gen._stream(SCOPE, never_disconnect, send))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if b"data: a\r\n\r\n" in written:
                break
        seen_before_wait = list(written)
        sub.queue.put_nowait("b")
        sub.queue.put_nowait(None)
        await task
        return seen_before_wait, written, sub.closed

    before, written, closed = asyncio.run(run())
    assert b"data: a\r\n\r\n" in before
    assert b"".join(written) == b"data: a\r\n\r\ndata: b\r\n\r\n" + DONE
    assert closed


def test_a_disconnect_ends_the_stream_and_reports_it_gone():
    closed: list[bool] = []
    cleaned: list[bool] = []

    async def run():
        async def events():
            try:
                yield frame("first")
                await asyncio.Event().wait()  # the next output never comes
                yield frame("never")
            finally:
                cleaned.append(True)

        async def receive():
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        response = SSEResponse(events(), end=DONE, closed=closed.append)
        await asyncio.wait_for(response(SCOPE, receive, send), 5)
        return sent

    sent = asyncio.run(run())
    assert closed == [True] and cleaned == [True]
    assert [m.get("body") for m in sent[1:]] == [b"data: first\r\n\r\n"]  # no [DONE], no closing body


def test_events_that_raise_are_not_reported_as_a_client_gone():
    closed: list[bool] = []

    async def run():
        async def events():
            yield frame("first")
            raise RuntimeError("forward pass failed")

        async def send(message):
            pass

        await SSEResponse(events(), closed=closed.append)(SCOPE, never_disconnect, send)

    with pytest.raises(RuntimeError, match="forward pass failed"):
        asyncio.run(run())
    assert closed == [False]


# ------------------------------------------------------------------------ the Gate's write deadline


def test_a_blocked_write_is_too_slow_after_the_limit():
    async def run():
        deadline = SendDeadline(0.1)

        async def blocked(message):
            await asyncio.sleep(3600)

        t = time.monotonic()
        with pytest.raises(ClientTooSlow):
            await deadline.write(blocked, {})
        deadline.close()
        assert asyncio.current_task().cancelling() == 0  # the cancellation was taken back
        return time.monotonic() - t

    assert 0.09 < asyncio.run(run()) < 1.0


def test_quick_writes_past_the_limit_in_total_never_trip():
    async def run():
        deadline = SendDeadline(0.05)
        writes = 0

        async def quick(message):
            nonlocal writes
            await asyncio.sleep(0.01)
            writes += 1

        t = time.monotonic()
        while time.monotonic() - t < 0.3:  # six limits' worth of 10 ms writes
            await deadline.write(quick, {})
        deadline.close()
        return writes

    assert asyncio.run(run()) >= 10


def test_a_cancelled_write_stays_a_cancellation():
    async def run():
        deadline = SendDeadline(10.0)

        async def blocked(message):
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(deadline.write(blocked, {}))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline.close()
        assert deadline._timer is None

    asyncio.run(run())
