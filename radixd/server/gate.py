"""The ``Gate``: pure ASGI middleware around every route.

It gives each request an id (``X-Request-Id``), checks API keys (constant-time) and the body
limit, bounds each write to the client (``server.send_timeout_s``), counts requests in
flight (the drain waits on ``ServerState.idle``) and writes one access-log line when the
response ends. Routes add token counts to ``scope["state"]["radixd"]`` for that line, and
``outcome`` when a response did not complete (``client_disconnected``, ``client_too_slow``);
an error response's OpenAI ``code`` and ``type`` are read from its body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from urllib.parse import parse_qs

from radixd.server.errors import ApiError
from radixd.server.state import ServerState

# The access log's status of a request whose client left before any response was sent:
# nginx's "client closed request" (HTTP has no code for it; proxies and log tools know 499).
CLIENT_CLOSED = 499
ERROR_BODY_CAP = 4096  # an error response's body read for its code (errors are small JSON)
DASHBOARD_PREFIX = "/dashboard"  # where the key may come as ?key= (EventSource cannot set headers)
OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}  # reachable without an API key (probes, scrapers)


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

        error_body = bytearray()
        deadline = SendDeadline(st.settings.server.send_timeout_s)

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode("latin-1"))]
            elif info["status"] >= 400 and len(error_body) < ERROR_BODY_CAP:
                error_body.extend(message.get("body", b"")[:ERROR_BODY_CAP])
                if not message.get("more_body"):
                    info.update(_error_of(error_body))
            deadline.limit = st.settings.server.send_timeout_s
            await deadline.write(send, message)

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
            info["status"] = info["status"] or CLIENT_CLOSED
            info.setdefault("outcome", "client_too_slow")
            st.metrics.slow_clients.inc()
            st.log.warning("client too slow; response ended", id=rid, path=scope["path"], reason=str(exc))
        finally:
            if info["status"] == 0:  # the app ended without a response: the client left first
                info["status"] = CLIENT_CLOSED
                info.setdefault("outcome", "client_disconnected")
            deadline.close()
            st.inflight -= 1
            if st.inflight == 0:
                st.idle.set()
            self._access(scope, info)

    def _check(self, scope, headers) -> ApiError | None:
        st = self.state
        if st.api_keys and scope["path"] not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not token and scope["path"].startswith(DASHBOARD_PREFIX):  # a browser sends no header
                token = _query_key(scope)
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
                outcome=info.get("outcome", "completed"), error_code=info.get("error_code"),
                error_type=info.get("error_type"),
                prompt_tokens=info.get("prompt_tokens"), completion_tokens=info.get("completion_tokens"),
                cached_tokens=info.get("cached_tokens"), ttft_ms=_ms(info.get("ttft")),
                duration_ms=_ms(time.perf_counter() - info["start"]),
            )


class ClientTooSlow(Exception):
    """A write to the client blocked longer than ``server.send_timeout_s``."""


class SendDeadline:
    """``write(send, message)``: ``send(message)``, raising ``ClientTooSlow`` if it blocks
    ``limit`` seconds, as an ``asyncio.timeout`` around each write would, with one timer per
    response instead of one per write (a stream writes once per token): the timer, armed by the
    first write, wakes when the write in progress at its arming could be due, and re-arms for
    the one in progress then (none: the next write arms it). Of two writes at once (a
    keep-alive beside an event) the first is timed. ``close()`` when the response is over."""

    __slots__ = ("limit", "since", "_task", "_cancelling", "_timer", "_fired")

    def __init__(self, limit: float):
        self.limit = limit
        self.since: float | None = None  # when the write in progress began
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def write(self, send, message) -> None:
        timed = self._begin()
        try:
            await send(message)
        except asyncio.CancelledError:
            if timed and self._expired():
                raise ClientTooSlow(f"a write to the client blocked for {self.limit} s") from None
            raise
        finally:
            if timed:
                self.since = None

    def _begin(self) -> bool:
        if self.since is not None:
            return False
        loop = asyncio.get_running_loop()
        self.since = loop.time()
        task = self._task = asyncio.current_task()
        self._cancelling = task.cancelling()
        if self._timer is None:
            self._timer = loop.call_at(self.since + self.limit, self._check)
        return True

    def _check(self) -> None:
        self._timer = None
        if self.since is None:
            return
        due = self.since + self.limit
        loop = asyncio.get_running_loop()
        if loop.time() >= due:
            self._fired = True
            self._task.cancel()
        else:
            self._timer = loop.call_at(due, self._check)

    def _expired(self) -> bool:
        """After a write's ``CancelledError``: whether it was this deadline's (then the
        cancellation is taken back, as ``asyncio.timeout`` does)."""
        if not self._fired:
            return False
        self._fired = False
        return self._task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


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


def _error_of(body: bytes) -> dict:
    """``error_code``/``error_type`` of an error response in OpenAI's shape, if it is one."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(err, dict):
        return {}
    return {"error_code": err.get("code"), "error_type": err.get("type")}


def _query_key(scope) -> str:
    keys = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key")
    return keys[0] if keys else ""


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)



class ErrorsAsJsonGate(Gate):
    """``add_middleware`` builds the gate outside starlette's error middleware, so an
    ``ApiError`` raised while reading the body still becomes a JSON response."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except ApiError as exc:
            await exc.response()(scope, receive, send)
