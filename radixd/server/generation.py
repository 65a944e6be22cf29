"""One HTTP request's generation: admission, submission, collecting or streaming outputs.

Every generation route (chat completions, completions, native ``/generate``), and the
embeddings route, goes through ``Generation``: ``Generation.start`` compiles grammars, applies
admission control and submits each prompt (engine errors become HTTP errors; a failure closes
what was already submitted); ``collect`` runs the submissions to completion (aborting them all if the client
disconnects), ``outputs`` interleaves them for a stream and ``stream`` frames that stream as
server-sent events ending in ``[DONE]``. Whichever way a request ends, its submissions are
closed and it is reported once (metrics, access log, ``radixd_request_finished``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixd.core.errors import ContextLengthExceeded, EngineStopped, InvalidRequest
from radixd.core.outputs import GenerateOutput, Submission
from radixd.core.sampling_params import SamplingParams
from radixd.plugins.guard import PluginFault
from radixd.server import protocol
from radixd.server.errors import ApiError
from radixd.server.sse import DONE, SSEResponse
from radixd.server.state import ServerState


async def compile_grammar(st: ServerState, params: SamplingParams, param_prefix: str = ""):
    """The request's grammar constraint, compiled off the loop (400 naming the field on error)."""
    try:
        return await st.engine.compile_grammar(params)
    except InvalidRequest as exc:
        raise ApiError(400, exc.message, param=param_prefix + exc.field) from exc


def submit(st: ServerState, request: Request, *, params: SamplingParams, prompt: str | None = None,
           input_ids: list[int] | None = None, priority: int = 0, shown: Any = None,
           grammar=None, rid: str | None = None, embed: bool = False) -> Submission:
    """Admission control + ``Engine.submit`` (``embed``: ``Engine.embed``, the prompt is the
    body's ``input``) with engine errors mapped to HTTP errors.
    ``shown``: what to log as the prompt (``logging.log_prompts``; default the prompt)."""
    if st.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    if params.n > st.settings.limits.max_n:  # invalid whatever the load: 400 before any 503
        raise ApiError(400, f"'n' must be <= {st.settings.limits.max_n}, got {params.n}", param="n")
    queued = st.engine.num_waiting
    if queued + params.n > st.settings.limits.max_queued_requests:
        raise ApiError(503, f"the server is overloaded ({queued} requests queued); retry later", code="queue_full")
    call = dict(input_ids=input_ids, priority=priority, rid=rid, max_unread=st.settings.server.stream_buffer)
    param = protocol.api_param if not embed else lambda f: "input" if f in ("prompt", "input_ids") else f
    try:
        sub = (st.engine.embed(prompt, **call) if embed else
               st.engine.submit(prompt, params=params, grammar=grammar, **call))
    except ContextLengthExceeded as exc:
        raise ApiError(400, exc.message, param=param(exc.field), code="context_length_exceeded") from exc
    except InvalidRequest as exc:
        raise ApiError(400, exc.message, param=param(exc.field)) from exc
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="shutting_down") from exc
    info = request.scope["state"]["radixd"]
    info["prompt_tokens"] = info.get("prompt_tokens", 0) + sub.prompt_tokens
    if st.settings.logging.log_prompts:  # at debug level: shown only with logging.level = "debug"
        st.log.debug("prompt", id=info["id"], rid=sub.rid, prompt=shown if shown is not None else
                     (prompt if prompt is not None else input_ids))
    try:
        st.hooks.call("radixd_request_received", rid=sub.rid, route=request.url.path,
                      prompt_tokens=sub.prompt_tokens, params=params)
    except PluginFault as exc:
        sub.close()  # a failing plugin must not leave the request queued
        raise ApiError(500, f"a server plugin failed: {exc}", code="plugin_error") from exc
    except BaseException:
        sub.close()
        raise
    return sub


class Tracker:
    """Timing and usage of one HTTP request's submissions: TTFT, inter-token gaps, token
    counts per submission -> metrics, the access log and ``radixd_request_finished``."""

    def __init__(self, st: ServerState, request: Request, subs: list[Submission]):
        self.st = st
        self.subs = subs
        self.info = request.scope["state"]["radixd"]
        self.t0 = self.info["start"]
        self.last: float | None = None
        self.tokens = [0] * len(subs)
        self.cached_of = [0] * len(subs)          # prompt tokens served from the cache, per prompt
        self.reasons: list[dict[int, str | None]] = [{} for _ in subs]
        self._done = False
        if st.dashboard is not None:  # its rows there show this TTFT
            st.dashboard.watch(self)

    @property
    def completion(self) -> int:
        return sum(self.tokens)

    @property
    def cached(self) -> int:
        return sum(self.cached_of)

    def see(self, out: GenerateOutput, i: int = 0) -> None:
        now = time.perf_counter()
        if out.token_ids:
            m = self.st.metrics
            if self.last is None:
                self.info["ttft"] = now - self.t0
                m.ttft.observe(now - self.t0)
            else:
                m.itl.observe(now - self.last)
            self.last = now
            m.generation_tokens.inc(len(out.token_ids))
        self.tokens[i] += len(out.token_ids)
        if out.finished:
            self.reasons[i][out.index] = out.finish_reason
            if out.index == 0:  # the sample that computed (or read) the prompt
                self.cached_of[i] = out.cached_tokens

    def done(self) -> None:
        """Report once, also when the client left early (unfinished samples: None)."""
        if self._done:
            return
        self._done = True
        m = self.st.metrics
        self.info["completion_tokens"] = self.completion
        self.info["cached_tokens"] = self.cached
        m.cached_tokens.inc(self.cached)
        m.e2e.observe(time.perf_counter() - self.t0)
        for i, sub in enumerate(self.subs):
            m.prompt_tokens.inc(sub.prompt_tokens)
            self.st.hooks.call(
                "radixd_request_finished", fail=False, rid=sub.rid, prompt_tokens=sub.prompt_tokens, completion_tokens=self.tokens[i],
                cached_tokens=self.cached_of[i], finish_reasons=[self.reasons[i].get(j) for j in range(sub.n)],
            )


async def until_disconnect(request: Request) -> None:
    """Return when the client goes away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(subs: list[Submission], request: Request, tracker: Tracker) -> list[list[GenerateOutput]]:
    """Run submissions to completion, aborting them all if the client disconnects."""

    async def drain(i: int, sub: Submission) -> list[GenerateOutput]:
        outs = []
        async for out in sub:
            tracker.see(out, i)
            outs.append(out)
        return outs

    work = asyncio.ensure_future(asyncio.gather(*(drain(i, s) for i, s in enumerate(subs))))
    work.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            for s in subs:
                s.close()
    if not work.done() or work.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return work.result()


async def merged(subs: list[Submission], maxsize: int = 0,
                 idle: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Interleave several submissions' outputs as they come: (submission index, output).
    ``maxsize`` bounds what waits here, so outputs a slow client does not take pile up in
    the engine, which aborts the call past ``server.stream_buffer``. ``idle()`` is awaited
    before each wait for an output (the stream writes what it held back)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize)

    async def pump(i: int, sub: Submission):
        try:
            async for out in sub:
                await queue.put((i, out))
            end = None
        except Exception as exc:  # surfaced to the consumer below
            end = exc
        await queue.put((i, end))  # not in a finally: a cancelled pump must not wait on a full queue

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(subs)]
    left = len(subs)
    try:
        while left:
            if idle is not None and queue.empty():
                await idle()
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in subs:
            s.close()


def sse_response(events: AsyncIterator[bytes | dict], subs: list[Submission], tracker: Tracker,
                 ping_s: float = 0.0, done: bool = True, ready: Callable[[], bool] | None = None) -> SSEResponse:
    """Stream ``events`` as SSE, end with ``[DONE]`` (unless not ``done``: the Responses API
    ends at its last event); however the stream ends (finished, client gone), close the
    submissions and report the request once. ``ping_s`` > 0: a keep-alive comment every that
    many seconds (``server.sse_ping_s``; 0: none). ``ready``: see ``SSEResponse``."""

    def closed(gone: bool) -> None:
        if gone:
            tracker.info.setdefault("outcome", "client_disconnected")
        for sub in subs:
            sub.close()
        tracker.done()

    return SSEResponse(events, ping_s, end=DONE if done else b"", ready=ready, closed=closed)


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Generation:
    """The submissions of one HTTP request (one per prompt) and their ``Tracker``."""

    def __init__(self, st: ServerState, request: Request, subs: list[Submission], leg=None):
        self.st = st
        self.request = request
        self.subs = subs
        self.tracker = Tracker(st, request, subs)
        self.leg = leg  # its part in a prefill/decode pair (radixd.server.disagg.Leg), or None
        self._stream: SSEResponse | None = None

    @classmethod
    async def start(cls, st: ServerState, request: Request, prompts: list[str | list[int]],
                    params: list[SamplingParams], *, priority: int = 0, shown: Any = None,
                    param_prefix: str = "", rids: list[str | None] | None = None, embed: bool = False) -> Generation:
        """Compile each distinct ``params``' grammar, then submit ``prompts[i]`` (text or token
        ids) with ``params[i]``. ``param_prefix``: where the sampling fields sit in the body
        (``"sampling_params."``), for the errors of grammars; ``shown``: see ``submit``; ``rids``:
        the request id of each prompt (None: the engine picks); ``embed``: embedding calls."""
        leg = None
        boot = request.scope["state"]["radixd"].get("bootstrap")
        if boot is not None:  # a prefill or decode role: the KV is sent or received around it
            leg = await st.disagg.begin(request, boot, prompts, params)
            prompts, params = leg.prompts, leg.params
        grammars: dict[int, Any] = {}
        for p in params:
            if id(p) not in grammars:
                grammars[id(p)] = await compile_grammar(st, p, param_prefix)
        subs: list[Submission] = []
        try:
            for prompt, p, rid in zip(prompts, params, rids or [None] * len(prompts), strict=True):
                kw = {"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
                subs.append(submit(st, request, params=p, priority=priority, shown=shown,
                                   grammar=grammars[id(p)], rid=rid, embed=embed, **kw))
        except ApiError:
            for s in subs:
                s.close()
            if leg is not None:
                leg.close()
            raise
        if leg is not None:
            leg.attach(subs)
        return cls(st, request, subs, leg)

    @property
    def rid(self) -> str:
        return self.subs[0].rid

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.subs)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.tracker.completion, self.tracker.cached)

    async def collect(self) -> list[list[GenerateOutput]]:
        """Every submission's outputs once all have finished; reported however it ends."""
        try:
            outs = await collect(self.subs, self.request, self.tracker)
            if self.leg is not None:
                await self.leg.finish(self.subs)
            return outs
        finally:
            self.tracker.done()
            if self.leg is not None:
                self.leg.close()

    def ready(self) -> bool:
        """Whether an output waits to be read (``outputs`` yields without waiting)."""
        return any(s.ready() for s in self.subs)

    async def outputs(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """(submission index, output) as they come, counted by the tracker. Before it waits
        for one, the stream writes the events it held back."""
        idle = self._stream.flush if self._stream is not None else None
        try:
            if len(self.subs) == 1:  # read directly: the engine bounds its unread outputs itself
                sub, see = self.subs[0], self.tracker.see
                while True:
                    if idle is not None and not sub.ready():
                        await idle()
                    try:
                        out = await sub.__anext__()
                    except StopAsyncIteration:
                        break
                    see(out)
                    yield 0, out
            else:
                source = merged(self.subs, self.st.settings.server.stream_buffer, idle)
                try:
                    async for i, out in source:
                        self.tracker.see(out, i)
                        yield i, out
                finally:
                    await source.aclose()
            if self.leg is not None:
                if idle is not None:  # the events so far leave before the wait for the peer
                    await idle()
                await self.leg.finish(self.subs)
        finally:
            if len(self.subs) == 1:
                self.subs[0].close()
            if self.leg is not None:
                self.leg.close()

    def stream(self, events: Callable[[], AsyncIterator[bytes]], done: bool = True) -> Response:
        """``events()`` (SSE bytes) as server-sent events, then ``[DONE]`` if ``done``; the
        events that ``outputs`` finds ready together are written together."""
        ready = self.subs[0].ready if len(self.subs) == 1 else self.ready
        self._stream = sse_response(events(), self.subs, self.tracker, self.st.settings.server.sse_ping_s, done,
                                    ready=ready)
        return self._stream


def samples(outs: list[GenerateOutput], n: int) -> list[list[GenerateOutput]]:
    """One submission's outputs split by sample (``GenerateOutput.index``), ``n`` samples."""
    return [[o for o in outs if o.index == i] for i in range(n)]
