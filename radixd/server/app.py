"""The starlette application: OpenAI-compatible and native routes over one ``Engine``.

``ServerState`` is the context object every handler reads (no module-global state). The
``Gate`` middleware gives each request an id, checks API keys (constant-time) and the body
limit, and writes one access-log line when the response ends.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixd import __version__
from radixd.core.engine import Engine, GenerateOutput, Submission
from radixd.core.errors import ContextLengthExceeded, EngineStopped, InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.plugins.guard import HookGuard, PluginFault
from radixd.server import protocol
from radixd.server.errors import ApiError
from radixd.server.metrics import Metrics
from radixd.settings import Settings

OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}  # reachable without an API key (probes, scrapers)


@dataclass
class ServerState:
    engine: Engine
    settings: Settings
    model_name: str
    api_keys: list[str]
    plugins: Any
    metrics: Metrics = field(init=False)
    hooks: HookGuard = field(init=False)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    log: Any = field(default_factory=lambda: structlog.get_logger("radixd.server"))
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine)
        p = self.settings.plugins
        self.hooks = HookGuard(self.plugins, on_error=p.on_error, timeout_s=p.hook_timeout_s,
                               on_fault=lambda plugin, hook, kind: self.metrics.plugin_faults.labels(
                                   plugin=plugin, hook=hook, kind=kind).inc())
        self.idle.set()

    def stalled(self) -> str | None:
        """Why the batching loop counts as stalled (a step running longer than
        ``server.stall_timeout_s``, or the loop ended), else None."""
        if self.engine.loop_stopped:
            return "batching loop stopped"
        limit = self.settings.server.stall_timeout_s
        age = self.engine.step_age()
        if limit and age > limit:
            return f"batching step running for {age:.1f} s (server.stall_timeout_s = {limit})"
        return None

    @property
    def limits(self) -> protocol.Limits:
        lim = self.settings.limits
        return protocol.Limits(default_max_tokens=lim.default_max_tokens, max_stop_sequences=lim.max_stop_sequences)


# ---------------------------------------------------------------------------------- gate


class Gate:
    """Pure ASGI middleware: request id, auth, body limit, access log, in-flight count."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        info = {"id": rid, "status": 0, "start": time.perf_counter()}
        scope.setdefault("state", {})["radixd"] = info

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode("latin-1"))]
            limit = st.settings.server.send_timeout_s
            try:
                async with asyncio.timeout(limit):
                    await send(message)
            except TimeoutError:
                raise ClientTooSlow(f"a write to the client blocked for {limit} s") from None

        st.inflight += 1
        st.idle.clear()
        try:
            error = self._check(scope, headers)
            if error is not None:
                if error.status == 413:
                    await _discard_body(receive, cap=64 * st.settings.server.max_body_bytes)
                await error.response()(scope, receive, send_wrapped)
                return
            limit = st.settings.server.max_body_bytes
            seen = 0

            async def receive_limited():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > limit:
                        if message.get("more_body"):
                            await _discard_body(receive, cap=64 * limit)
                        raise ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")
                return message

            await self.app(scope, receive_limited, send_wrapped)
        except ClientTooSlow as exc:
            # the client stopped reading: end the response (the connection closes; the
            # request was aborted with its stream), never wait on it
            info["status"] = info["status"] or 499
            st.metrics.slow_clients.inc()
            st.log.warning("client too slow; response ended", id=rid, path=scope["path"], reason=str(exc))
        finally:
            st.inflight -= 1
            if st.inflight == 0:
                st.idle.set()
            self._access(scope, info)

    def _check(self, scope, headers) -> ApiError | None:
        st = self.state
        if st.api_keys and scope["path"] not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            ok = False
            for key in st.api_keys:  # compare against every key: time does not tell which matched
                ok |= hmac.compare_digest(token.encode(), key.encode())
            if not ok:
                return ApiError(401, "missing or invalid API key" if token else "missing API key "
                                "(send 'Authorization: Bearer <key>')", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > st.settings.server.max_body_bytes:
            return ApiError(413, f"request body exceeds {st.settings.server.max_body_bytes} bytes",
                            code="body_too_large")
        return None

    def _access(self, scope, info) -> None:
        st = self.state
        route = scope["path"] if scope.get("route") is None else scope["route"].path
        st.metrics.requests.labels(route=route if info["status"] != 404 else "unmatched", status=str(info["status"])).inc()
        if st.settings.logging.access_log:
            st.log.info(
                "access", id=info["id"], method=scope["method"], path=scope["path"], status=info["status"],
                prompt_tokens=info.get("prompt_tokens"), completion_tokens=info.get("completion_tokens"),
                cached_tokens=info.get("cached_tokens"), ttft_ms=_ms(info.get("ttft")),
                duration_ms=_ms(time.perf_counter() - info["start"]),
            )


class ClientTooSlow(Exception):
    """A write to the client blocked longer than ``server.send_timeout_s``."""


async def _discard_body(receive, cap: int) -> None:
    """Read and drop the rest of a refused body (up to ``cap`` bytes), so a client that sends
    its whole body before reading gets the error response instead of a reset connection."""
    seen = 0
    while seen <= cap:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body"):
            return


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# ---------------------------------------------------------------------------------- helpers


async def read_json(request: Request) -> dict:
    body = await request.body()
    try:
        data = json.loads(body, parse_float=_number)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise ApiError(400, "the body is nested too deeply", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    _check_strings(data)
    return data


def _number(text: str) -> float | int:
    """A JSON number with a fraction or exponent: an integer when it is whole (``2.0``,
    ``1e3``), as JSON Schema counts it, so integer fields accept it."""
    value = float(text)
    return int(value) if value.is_integer() else value


def _check_strings(value: Any, depth: int = 0) -> None:
    """Refuse strings that are not Unicode text (a lone surrogate, ``"\\ud800"``, is valid
    JSON but cannot be encoded, so the tokenizer would fail on it) and deep nesting."""
    if depth > 64:
        raise ApiError(400, "the body is nested too deeply (more than 64 levels)", code="invalid_json")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"the body holds a string that is not valid Unicode ({exc.reason} at "
                                f"position {exc.start})", code="invalid_json") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, depth + 1)
            _check_strings(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, depth + 1)


def state_of(request: Request) -> ServerState:
    return request.app.state.radixd


def check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{st.model_name}'",
                       param="model", code="model_not_found")


async def compile_grammar(st: ServerState, params: SamplingParams, param_prefix: str = ""):
    """The request's grammar constraint, compiled off the loop (400 naming the field on error)."""
    try:
        return await st.engine.compile_grammar(params)
    except InvalidRequest as exc:
        raise ApiError(400, exc.message, param=param_prefix + exc.field) from exc


def submit(st: ServerState, request: Request, *, params: SamplingParams, prompt: str | None = None,
           input_ids: list[int] | None = None, priority: int = 0, shown: Any = None,
           grammar=None) -> Submission:
    """Admission control + ``Engine.submit`` with engine errors mapped to HTTP errors.
    ``shown``: what to log as the prompt (``logging.log_prompts``; default the prompt)."""
    if st.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    if params.n > st.settings.limits.max_n:  # invalid whatever the load: 400 before any 503
        raise ApiError(400, f"'n' must be <= {st.settings.limits.max_n}, got {params.n}", param="n")
    queued = st.engine.num_waiting
    if queued + params.n > st.settings.limits.max_queued_requests:
        raise ApiError(503, f"the server is overloaded ({queued} requests queued); retry later", code="queue_full")
    try:
        sub = st.engine.submit(prompt, input_ids=input_ids, params=params, priority=priority,
                               max_unread=st.settings.server.stream_buffer, grammar=grammar)
    except ContextLengthExceeded as exc:
        raise ApiError(400, f"{exc.message} (prompt {exc.prompt_tokens} tokens, context {exc.limit} tokens)",
                       param=_api_param(exc.field), code="context_length_exceeded") from exc
    except InvalidRequest as exc:
        raise ApiError(400, exc.message, param=_api_param(exc.field)) from exc
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


def chat_prompt_ids(st: ServerState, messages: list[dict]) -> list[int]:
    """The chat template applied to ``messages``, with text in their contents that spells a
    special token (``<|im_start|>``, ``<eos>``, ...) handled per ``limits.chat_special_tokens``:
    such text would otherwise become the control token itself, letting a message open a new
    turn under another role. "refuse": 400; "as_text": tokenized as plain text; "allow": as is."""
    how = st.settings.limits.chat_special_tokens
    tok = st.engine.tokenizer
    found = None if how == "allow" else _special_text(tok, messages)
    try:
        if found is None:
            return st.engine.apply_chat_template(messages)
        if how == "refuse":
            i, text = found
            raise ApiError(400, f"'messages[{i}].content' contains the special token text {text!r}; this server "
                                "refuses it (limits.chat_special_tokens = \"refuse\")", param="messages",
                           code="special_token_in_content")
        return _template_contents_as_text(tok, messages)
    except ApiError:
        raise
    except Exception as exc:  # templates raise on e.g. a bad role order
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc


def _special_text(tok, messages: list[dict]) -> tuple[int, str] | None:
    specials = [t for t in tok.all_special_tokens if t]
    specials += [a.content for a in tok.added_tokens_decoder.values() if a.special and a.content not in specials]
    for i, m in enumerate(messages):
        for text in specials:
            if text in m["content"]:
                return i, text
    return None


def _template_contents_as_text(tok, messages: list[dict]) -> list[int]:
    """Render the template around placeholders, then tokenize the template's own text with
    its special tokens and each message content with special-token text split into plain
    tokens: no content can produce a control token."""
    nonce = uuid.uuid4().hex
    marks = [f"\u241f{nonce}{i}\u241f" for i in range(len(messages))]
    rendered = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
                                       add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for i, mark in enumerate(marks):
        head, sep, rendered = rendered.partition(mark)
        if not sep:
            raise ValueError(f"the template does not show messages[{i}].content as given")
        ids += tok(head, add_special_tokens=False).input_ids
        ids += tok(messages[i]["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids + tok(rendered, add_special_tokens=False).input_ids


def _api_param(field_name: str) -> str:
    return {"max_new_tokens": "max_tokens", "input_ids": "prompt"}.get(field_name, field_name)


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


async def merged(subs: list[Submission], maxsize: int = 0) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """Interleave several submissions' outputs as they come: (submission index, output).
    ``maxsize`` bounds what waits here, so outputs a slow client does not take pile up in
    the engine, which aborts the call past ``server.stream_buffer``."""
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


def sse_response(events: AsyncIterator[dict], subs: list[Submission], tracker: Tracker) -> Response:
    """Stream ``events`` as SSE, end with ``[DONE]``; however the stream ends (finished,
    client gone), close the submissions and report the request once."""

    async def framed():
        try:
            async for event in events:
                yield event
            yield {"data": "[DONE]"}
        finally:
            for sub in subs:
                sub.close()
            tracker.done()

    return EventSourceResponse(framed(), ping=15)


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(tok, outs: list[GenerateOutput]) -> dict:
    content = []
    for out in outs:
        for lp in out.logprobs or []:
            text = token_text(tok, lp.token_id)
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := token_text(tok, i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top],
            })
    return {"content": content}


def completion_logprobs(tok, outs: list[GenerateOutput], offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for out in outs:
        for lp in out.logprobs or []:
            text = token_text(tok, lp.token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            lps.append(lp.logprob)
            tops.append({token_text(tok, i): v for i, v in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def sse(payload: dict) -> dict:
    return {"data": json.dumps(payload, separators=(",", ":"))}


# ---------------------------------------------------------------------------------- routes


async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, protocol.CHAT_FIELDS)
    parsed = protocol.sampling_from_openai(body, st.limits, chat=True)
    check_model(st, parsed.model)
    messages = protocol.chat_messages(body)
    ids = chat_prompt_ids(st, messages)
    grammar = await compile_grammar(st, parsed.params)
    sub = submit(st, request, params=parsed.params, input_ids=ids, priority=parsed.priority, shown=messages,
                 grammar=grammar)
    tracker = Tracker(st, request, [sub])
    cid = f"chatcmpl-{sub.rid}"
    created = int(time.time())
    tok = st.engine.tokenizer

    if not parsed.stream:
        try:
            outs = (await collect([sub], request, tracker))[0]
        finally:
            tracker.done()
        choices = []
        for i in range(parsed.params.n):
            mine = [o for o in outs if o.index == i]
            choices.append({
                "index": i,
                "message": {"role": "assistant", "content": "".join(o.text for o in mine)},
                "logprobs": chat_logprobs(tok, mine) if parsed.params.logprobs else None,
                "finish_reason": mine[-1].finish_reason,
            })
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": usage(sub.prompt_tokens, tracker.completion, tracker.cached),
            "system_fingerprint": f"radixd-{__version__}",
        })

    async def events():
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": f"radixd-{__version__}"}
        for i in range(parsed.params.n):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for _, out in merged([sub], st.settings.server.stream_buffer):
            tracker.see(out)
            lp = chat_logprobs(tok, [out]) if parsed.params.logprobs and out.token_ids else None
            if out.text or lp or out.finished:
                yield sse({**base, "choices": [{
                    "index": out.index, "delta": {"content": out.text} if out.text else {}, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}]})
        if parsed.include_usage:
            yield sse({**base, "choices": [], "usage": usage(sub.prompt_tokens, tracker.completion, tracker.cached)})

    return sse_response(events(), [sub], tracker)


async def completions(request: Request) -> Response:
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, protocol.COMPLETION_FIELDS)
    parsed = protocol.sampling_from_openai(body, st.limits, chat=False)
    check_model(st, parsed.model)
    prompts = protocol.completion_prompts(body)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be a boolean", param="echo")
    if echo and parsed.params.logprobs:
        raise ApiError(400, "'echo' together with 'logprobs' (prompt logprobs) is not supported", param="echo",
                       code="unsupported_parameter")
    subs: list[Submission] = []
    grammar = await compile_grammar(st, parsed.params)
    try:
        for p in prompts:
            if isinstance(p, str):
                subs.append(submit(st, request, params=parsed.params, prompt=p, priority=parsed.priority,
                                   grammar=grammar))
            else:
                subs.append(submit(st, request, params=parsed.params, input_ids=p, priority=parsed.priority,
                                   grammar=grammar))
    except ApiError:
        for s in subs:
            s.close()
        raise
    tok = st.engine.tokenizer
    n = parsed.params.n
    tracker = Tracker(st, request, subs)
    cid = f"cmpl-{subs[0].rid}"
    created = int(time.time())
    prompt_total = sum(s.prompt_tokens for s in subs)
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if echo else "" for p in prompts]

    if not parsed.stream:
        try:
            results = await collect(subs, request, tracker)
        finally:
            tracker.done()
        choices = []
        for pi, outs in enumerate(results):
            for i in range(n):
                mine = [o for o in outs if o.index == i]
                choices.append({
                    "index": pi * n + i, "text": echoes[pi] + "".join(o.text for o in mine),
                    "logprobs": completion_logprobs(tok, mine, len(echoes[pi])) if parsed.params.logprobs else None,
                    "finish_reason": mine[-1].finish_reason,
                })
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
                             "choices": choices, "usage": usage(prompt_total, tracker.completion, tracker.cached)})

    async def events():
        base = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name}
        offsets: dict[int, int] = {}
        if echo:
            for pi in range(len(prompts)):
                for i in range(n):
                    yield sse({**base, "choices": [{"index": pi * n + i, "text": echoes[pi], "logprobs": None,
                                                    "finish_reason": None}]})
        async for pi, out in merged(subs, st.settings.server.stream_buffer):
            tracker.see(out, pi)
            idx = pi * n + out.index
            lp = None
            if parsed.params.logprobs:
                lp = completion_logprobs(tok, [out], offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(out.text)
            if out.text or out.token_ids or out.finished:
                yield sse({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                "finish_reason": out.finish_reason if out.finished else None}]})
        if parsed.include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_total, tracker.completion, tracker.cached)})

    return sse_response(events(), subs, tracker)


async def native_generate(request: Request) -> Response:
    """SGLang-style ``/generate``: ``text`` or ``input_ids`` plus ``sampling_params``. A list
    of texts (or of token-id lists) is a batch, submitted together (so its prompts share a
    step), with one ``sampling_params`` for all or a list of one per prompt; a batch does not
    stream and its answer is a list, one entry per prompt."""
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, protocol.NATIVE_FIELDS)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of 'text' or 'input_ids'", param="text")
    batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if text is not None:
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "'text' must be a string or a non-empty list of strings", param="text")
        prompts: list = texts
    else:
        lists = ids if batch else [ids]
        if not lists or not all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
                                for x in lists):
            raise ApiError(400, "'input_ids' must be a list of integers or a non-empty list of such lists",
                           param="input_ids")
        prompts = lists
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if not batch or len(sp) != len(prompts):
            raise ApiError(400, "a list of 'sampling_params' needs a batch of as many prompts", param="sampling_params")
        params = [protocol.sampling_from_native(x) for x in sp]
    else:
        params = [protocol.sampling_from_native(sp)] * len(prompts)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    if stream and batch:
        raise ApiError(400, "a batch of prompts cannot stream", param="stream")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ApiError(400, "'priority' must be an integer", param="priority")
    grammars = [await compile_grammar(st, ps, "sampling_params.") for ps in params]
    subs: list[Submission] = []
    try:
        for p, ps, g in zip(prompts, params, grammars, strict=True):
            kw = {"prompt": p} if isinstance(p, str) else {"input_ids": p}
            subs.append(submit(st, request, params=ps, priority=priority, grammar=g, **kw))
    except ApiError:
        for s in subs:
            s.close()
        raise
    tracker = Tracker(st, request, subs)

    def item(sub: Submission, i: int, text: str, ids: list[int], last: GenerateOutput | None,
             prompt_lp: list[float] | None = None) -> dict:
        meta = {"id": sub.rid, "finish_reason": last.finish_reason if last and last.finished else None,
                "prompt_tokens": sub.prompt_tokens, "completion_tokens": len(ids),
                "cached_tokens": last.cached_tokens if last else 0}
        if prompt_lp is not None:
            meta["prompt_logprobs"] = prompt_lp
        return {"index": i, "text": text, "output_ids": ids, "meta_info": meta}

    if not stream:
        try:
            results = await collect(subs, request, tracker)
        finally:
            tracker.done()
        answers = []
        for sub, ps, outs in zip(subs, params, results, strict=True):
            items = []
            for i in range(ps.n):
                mine = [o for o in outs if o.index == i]
                plp = next((o.prompt_logprobs for o in mine if o.prompt_logprobs is not None), None)
                items.append(item(sub, i, "".join(o.text for o in mine), [t for o in mine for t in o.token_ids],
                                  mine[-1] if mine else None, plp))
            answers.append(items[0] if ps.n == 1 else items)
        return JSONResponse(answers if batch else answers[0])

    sub = subs[0]

    async def events():
        texts: dict[int, str] = {}
        toks: dict[int, list[int]] = {}
        async for _, out in merged([sub], st.settings.server.stream_buffer):
            tracker.see(out)
            texts[out.index] = texts.get(out.index, "") + out.text
            toks.setdefault(out.index, []).extend(out.token_ids)
            yield sse(item(sub, out.index, texts[out.index], toks[out.index], out, out.prompt_logprobs))

    return sse_response(events(), [sub], tracker)


async def models(request: Request) -> Response:
    st = state_of(request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def model_by_id(request: Request) -> Response:
    st = state_of(request)
    check_model(st, request.path_params["model"])
    return JSONResponse(_model_card(st))


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "radixd",
            "max_model_len": st.engine.context_len}


async def health(request: Request) -> Response:
    """200 only if the batching loop is alive and completes a one-token generation in time."""
    st = state_of(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    stalled = st.stalled()
    if stalled:
        return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
    t0 = time.perf_counter()
    try:
        sub = st.engine.submit(input_ids=[st.engine.eos_token_ids[0] if st.engine.eos_token_ids else 0],
                               params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
        async with asyncio.timeout(st.settings.server.health_timeout_s):
            async for _ in sub:
                pass
    except TimeoutError:
        sub.close()
        return JSONResponse({"status": "generation timed out"}, status_code=503)
    except (EngineStopped, InvalidRequest) as exc:
        return JSONResponse({"status": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok", "generate_ms": round((time.perf_counter() - t0) * 1000, 2)})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    st = state_of(request)
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def flush_cache(request: Request) -> Response:
    st = state_of(request)
    if not st.engine.flush_cache():
        raise ApiError(400, "the cache is in use by running requests; retry when idle", code="cache_in_use")
    return JSONResponse({"flushed": True})


async def server_info(request: Request) -> Response:
    st = state_of(request)
    settings = asdict(st.settings)
    settings.pop("auth", None)  # never expose keys
    return JSONResponse({
        "version": __version__, "model": st.model_name, "context_len": st.engine.context_len,
        "device": str(st.engine.device), "dtype": str(st.engine.dtype).removeprefix("torch."),
        "settings": settings, "stats": st.engine.stats(), "draining": st.draining,
        "plugins": [name for name, plugin in st.plugins.list_name_plugin() if plugin is not None],
    })


async def tokenize(request: Request) -> Response:
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, set(protocol.TOKENIZE_SCHEMAS))
    check_model(st, body.get("model"))
    if "messages" in body:
        ids = chat_prompt_ids(st, protocol.chat_messages(body))
    elif isinstance(body.get("prompt"), str):
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise ApiError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        ids = st.engine.tokenizer(body["prompt"], add_special_tokens=add).input_ids
    else:
        raise ApiError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": st.engine.context_len})


async def detokenize(request: Request) -> Response:
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, set(protocol.DETOKENIZE_SCHEMAS))
    check_model(st, body.get("model"))
    toks = body.get("tokens")
    vocab = st.engine.model_cfg.vocab_size
    if not (isinstance(toks, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in toks)):
        raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": st.engine.tokenizer.decode(toks)})


async def apply_chat_template(request: Request) -> Response:
    """Render chat messages with the model's template, as text (clients building prompts
    turn by turn, such as ``radixd.lang``, use it to find each role's wrapping)."""
    st = state_of(request)
    body = await read_json(request)
    protocol.check_fields(body, set(protocol.TEMPLATE_SCHEMAS))
    check_model(st, body.get("model"))
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise ApiError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    if st.engine.tokenizer is None:
        raise ApiError(400, "this server runs without a tokenizer", param="messages")
    try:
        text = st.engine.tokenizer.apply_chat_template(protocol.chat_messages(body), tokenize=False,
                                                       add_generation_prompt=gen)
    except Exception as exc:  # the template itself refused (a jinja raise_exception)
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    return JSONResponse({"text": text})


async def openapi(request: Request) -> Response:
    from radixd.server.openapi import openapi_document

    return JSONResponse(openapi_document(state_of(request)))


# ---------------------------------------------------------------------------------- app


async def _api_error(request: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.url.path}").response()
    return ApiError(exc.status_code, str(exc.detail)).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    state_of(request).log.exception("unhandled error", path=request.url.path)
    return ApiError(500, "internal server error").response()


def build_app(state: ServerState) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_by_id, methods=["GET"]),
        Route("/generate", native_generate, methods=["POST"]),
        Route("/apply_chat_template", apply_chat_template, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
    ]
    for extra in state.plugins.hook.radixd_routes(state=state):
        routes.extend(extra or [])
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.radixd = state
    app.add_middleware(_GateFactory, state=state)
    origins = list(state.settings.server.cors_origins)
    if origins:  # outside the gate: a browser's preflight carries no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"], max_age=600)
    return app


class _GateFactory(Gate):
    """``add_middleware`` builds the gate outside starlette's error middleware, so an
    ``ApiError`` raised while reading the body still becomes a JSON response."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
