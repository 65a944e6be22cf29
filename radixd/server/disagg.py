"""Prefill/decode disaggregation, the HTTP side: one request's trip through a prefill and a
decode instance, on SGLang's protocol, as SGLang's gateway (``smg``) drives it.

The gateway sends the same body to both instances with ``bootstrap_host``,
``bootstrap_port`` (the prefill instance's bootstrap server) and ``bootstrap_room`` (the
request's number) added; ``bootstrap.take_bootstrap`` takes them off the body as it is read.

* Prefill (``[disaggregation] mode = "prefill"``): the request runs with one new token; the
  prompt's KV stays in the radix cache. Once it is computed and the decode instance has said
  where to write (``/kv/transfer`` on the bootstrap server), the cached slots are pinned and
  written into the decode side's reserved slots by the transfer engine, and the first token
  goes with the success report; then the prefill response is answered.
* Decode (``mode = "decode"``): the prefill rank is looked up (``GET /route``, retried while
  it answers 503 or does not answer, up to ``bootstrap_timeout_s``), slots are reserved for
  the prompt, the decode pool is registered with the prefill side once, the slots are sent
  and the reports followed (``heartbeat_interval_s``; three silent ones: failed), up to
  ``transfer_timeout_s``. The received KV becomes a cached prefix and the request is
  submitted as any other: admission finds the prompt cached and computes only its last
  position, sampling the first token itself (a greedy request's must equal the prefill
  side's, which came with the success report: a mismatch is counted). On any failure the room is aborted on the prefill side (whose answer waits for
  a write under way to end) before the reserved slots go back, and the request gets a clear
  error (502: the transfer failed, 504: it timed out, 503: no KV room) that the gateway may
  retry.

Contract: ``Disagg.start`` makes one per daemon (None when colocated); everything runs on the
daemon's event loop; ``Generation`` calls ``begin`` before submitting a request that
carries bootstrap fields and the returned ``Leg``'s ``finish`` / ``close`` after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field

import httpx
import structlog
import torch
from prometheus_client import Counter, Gauge, Histogram

from radixd.core import disagg as core
from radixd.core.disagg import KVPoll, PoolLayout
from radixd.core.errors import ConfigError
from radixd.core.sampling_params import SamplingParams
from radixd.server import bootstrap
from radixd.server.bootstrap import Bootstrap
from radixd.server.errors import ApiError
from radixd.server.generation import until_disconnect

log = structlog.get_logger("radixd.disagg")
class TransferFailed(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Metrics:
    def __init__(self, registry, role: str):
        self.bytes = Counter("radixd_pd_transfer_bytes", "KV bytes sent (prefill) or received (decode).",
                             registry=registry)
        self.seconds = Histogram("radixd_pd_transfer_seconds", "Transfer time of one request's KV, from both "
                                 "ends known to written.", registry=registry)
        self.outcomes = Counter("radixd_pd_transfers", "Requests' KV transfers by outcome.", ["outcome"],
                                registry=registry)
        self.waiting = Gauge("radixd_pd_waiting_for_kv", "Requests waiting for their KV transfer (decode) or "
                             "for their decode instance (prefill).", registry=registry)
        self.mismatches = Counter("radixd_pd_first_token_mismatches", "Greedy requests whose first token on the "
                                  "decode side differs from the prefill side's (decode).", registry=registry)
        Gauge("radixd_pd_role", "This instance's disaggregation role.", ["role"], registry=registry).labels(
            role=role).set(1)


# ------------------------------------------------------------------ the prefill side


@dataclass
class Room:
    """One bootstrap room on the prefill side: the decode side's slots (``target``), the
    prefill request's end (``ready``: prompt ids, first token), the write, the outcome."""

    number: int
    state: KVPoll = KVPoll.BOOTSTRAPPING
    target: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ready: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    outcome: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    writing: asyncio.Future | None = None
    claimed: bool = False  # its prefill request arrived
    created: float = field(default_factory=time.monotonic)

    def fail(self, reason: str) -> None:
        if not self.outcome.done():
            self.state = KVPoll.FAILED
            self.outcome.set_result({"error": reason})


class PrefillRooms:
    """The prefill side's rooms and the decode pools registered with it; does the writes."""

    def __init__(self, d: Disagg):
        self.d = d
        self.rooms: dict[int, Room] = {}
        self.decoders: dict[str, PoolLayout] = {}
        self._purged = time.monotonic()

    def room(self, number: int) -> Room:
        """Room ``number``, made by whichever side asks first. A room failed before its
        prefill request came (aborted by the decode side) stays, so that request fails at
        once; finished rooms are forgotten after twice the bootstrap timeout."""
        now = time.monotonic()
        if now - self._purged > self.d.cfg.bootstrap_timeout_s:
            self._purged = now
            old = now - 2 * self.d.cfg.bootstrap_timeout_s
            self.rooms = {n: r for n, r in self.rooms.items() if not (r.outcome.done() and r.created < old)}
        r = self.rooms.get(number)
        if r is None or (r.outcome.done() and r.ready.done()):  # a finished exchange: the number is free
            r = self.rooms[number] = Room(number)
        return r

    def target(self, number: int, session: str, slots: list[int], num_tokens: int) -> Room:
        r = self.room(number)
        if r.target.done():
            r.fail(f"bootstrap_room {number} was claimed by two decode requests")
        else:
            r.target.set_result((session, slots, num_tokens))
            if r.state == KVPoll.BOOTSTRAPPING:
                r.state = KVPoll.WAITING_FOR_INPUT
        return r

    async def report(self, r: Room):
        """``/kv/transfer``'s answer: heartbeats, then the outcome. A decode side that leaves
        fails the room (its slots are no longer reserved for us)."""
        cfg = self.d.cfg
        done = False
        try:
            while not r.outcome.done():
                if not r.claimed and time.monotonic() - r.created > cfg.bootstrap_timeout_s:
                    r.fail(f"no prefill request for bootstrap_room {r.number} within {cfg.bootstrap_timeout_s} s")
                    break
                yield bootstrap.line(r.state)
                try:
                    await asyncio.wait_for(asyncio.shield(r.outcome), cfg.heartbeat_interval_s)
                except TimeoutError:
                    pass
            out = r.outcome.result()
            done = True
            yield bootstrap.line(KVPoll.FAILED if "error" in out else KVPoll.SUCCESS, **out)
        finally:
            if not done:
                await self._end_write(r)
                r.fail("the decode instance left")
            if self.rooms.get(r.number) is r and r.ready.done():
                del self.rooms[r.number]

    async def _end_write(self, r: Room) -> None:
        if r.writing is not None:
            await asyncio.shield(r.writing)

    async def abort(self, number: int) -> KVPoll:
        r = self.room(number)
        await self._end_write(r)
        r.fail("aborted by the decode instance")
        return r.state

    async def send(self, r: Room, ids: list[int], first_token: int | None) -> None:
        """The prompt ``ids`` is computed: write its KV to the decode side, report."""
        cfg, m, engine = self.d.cfg, self.d.metrics, self.d.engine
        r.ready.set_result(None)
        m.waiting.inc()
        try:
            session, slots, num_tokens = await asyncio.wait_for(asyncio.shield(r.target), cfg.bootstrap_timeout_s)
        except TimeoutError:
            r.fail(f"no decode instance asked for bootstrap_room {r.number} within {cfg.bootstrap_timeout_s} s")
            raise TransferFailed(504, r.outcome.result()["error"]) from None
        finally:
            m.waiting.dec()
        if r.outcome.done():
            raise TransferFailed(502, r.outcome.result()["error"])
        if num_tokens != len(ids):
            r.fail(f"the decode instance reserved {num_tokens} tokens for a {len(ids)}-token prompt")
            raise TransferFailed(502, r.outcome.result()["error"])
        held = core.hold(engine, ids)
        if held is None:
            r.fail("the prompt's KV left the radix cache before it was sent")
            raise TransferFailed(503, r.outcome.result()["error"])
        node, src = held
        t0 = time.perf_counter()
        try:
            srcs, dsts, lens = core.transfer_ranges(self.d.layout, src, self.decoders[session],
                                                    torch.tensor(slots, dtype=torch.int64))
            r.state = KVPoll.TRANSFERRING
            r.writing = asyncio.ensure_future(asyncio.to_thread(self.d.transport.write, session, srcs, dsts, lens))
            await asyncio.shield(r.writing)
        except (ValueError, RuntimeError, KeyError) as exc:
            r.fail(f"KV write failed: {exc}")
            m.outcomes.labels(outcome="failed").inc()
            raise TransferFailed(502, r.outcome.result()["error"]) from exc
        finally:
            if r.writing is not None and not r.writing.done():
                await asyncio.shield(r.writing)  # cancelled: the slots stay pinned until it ends
            core.let_go(engine, node)
        if r.outcome.done():  # aborted while writing
            raise TransferFailed(502, r.outcome.result()["error"])
        nbytes = sum(lens)
        m.bytes.inc(nbytes)
        m.seconds.observe(time.perf_counter() - t0)
        m.outcomes.labels(outcome="success").inc()
        r.state = KVPoll.SUCCESS
        r.outcome.set_result({"first_token": first_token, "bytes": nbytes})


# ------------------------------------------------------------------ both sides


async def _unless_gone(request, coro):
    """``coro``'s result, or ``CancelledError`` (``coro`` cancelled) if the client leaves first."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # its clean-up (a write under way ends first) is done
    if work.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return work.result()


class Leg:
    """One request's part in a prefill or decode role, between ``begin`` and ``close``."""

    def __init__(self, d: Disagg, request, prompts: list, params: list[SamplingParams], room: Room | None = None,
                 first_token: int | None = None):
        self.d = d
        self.request = request
        self.prompts = prompts
        self.params = params
        self.room = room  # prefill: the request's room
        self.first_token = first_token  # decode: the token the prefill side sampled

    def attach(self, subs) -> None:
        """The request's submissions: a room failed on the decode side's word (an abort) ends
        the prefill computation too."""
        if self.room is not None:
            self.room.outcome.add_done_callback(
                lambda f: "error" in f.result() and [s.close() for s in subs])

    async def finish(self, subs) -> None:
        """The request's outputs are all out (prefill: send its KV before answering; decode:
        a greedy request's first token must be the prefill side's, else the KV it received
        was not the prompt's: counted and logged)."""
        req = subs[0].reqs[0]
        if self.room is None:
            if (self.first_token is not None and self.params[0].temperature == 0 and req.output_ids
                    and req.output_ids[0] != self.first_token):
                self.d.metrics.mismatches.inc()
                log.warning("first token differs from the prefill side's", rid=subs[0].rid,
                            prefill=self.first_token, decode=req.output_ids[0])
            return
        try:
            await _unless_gone(self.request, self.d.rooms.send(self.room, list(req.prompt_ids),
                                                                req.output_ids[0] if req.output_ids else None))
        except TransferFailed as exc:
            raise ApiError(exc.status, f"KV transfer to the decode instance failed: {exc}",
                           code="kv_transfer_failed") from exc

    def close(self) -> None:
        r = self.room
        if r is not None:
            if not r.ready.done():
                r.ready.set_result(None)
            r.fail("the prefill request ended before its KV was sent")
            if self.d.rooms.rooms.get(r.number) is r and not r.target.done():
                del self.d.rooms.rooms[r.number]


class Disagg:
    """A daemon's prefill or decode role: the transfer engine, the pool's layout, the rooms
    (prefill) and the bootstrap server (prefill)."""

    def __init__(self, st, transport, layout: PoolLayout):
        self.st = st
        self.cfg = st.settings.disaggregation
        self.mode = self.cfg.mode
        self.engine = st.engine
        self.transport = transport
        self.layout = layout
        self.metrics = _Metrics(st.metrics.registry, self.mode)
        self.rooms = PrefillRooms(self)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self.registered: set[str] = set()  # prefill ranks holding this decode pool's layout
        self._shutdown = asyncio.Event()
        self._server: asyncio.Task | None = None

    @classmethod
    async def start(cls, st, plugins) -> Disagg | None:
        cfg = st.settings.disaggregation
        if cfg.mode == "off":
            return None
        ec = st.engine.config
        if ec.dp_size != 1 or ec.tp_size != 1:
            raise ConfigError("disaggregation.mode", cfg.mode, "one replica and one shard (dp_size = tp_size = 1)")
        if not st.engine.cache.enabled:
            raise ConfigError("disaggregation.mode", cfg.mode, "the radix cache on (cache.radix = true)")
        if st.engine.worker.pool.to_window is not None:  # (the transfer moves one row per slot per buffer)
            raise ConfigError("disaggregation.mode", cfg.mode,
                              "a model whose KV has no window region (sliding-window layers' KV is not transferred)")
        backends: dict[str, type] = {}
        for table in plugins.hook.radixd_kv_transfer_backends():
            backends.update(table or {})
        if cfg.transfer_backend not in backends:
            raise ConfigError("disaggregation.transfer_backend", cfg.transfer_backend,
                              f"one of {', '.join(sorted(backends)) or '(none loaded)'}")
        host = st.settings.server.host if st.settings.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        transport = await asyncio.to_thread(backends[cfg.transfer_backend], host, {"ib_device": cfg.ib_device})
        layout = PoolLayout.of(st.engine)
        transport.register(layout.buffers())
        d = cls(st, transport, layout)
        if cfg.mode == "prefill":
            await d._serve_bootstrap(host)
        log.info("disaggregation", mode=cfg.mode, backend=cfg.transfer_backend, session=transport.session_id,
                 bootstrap_port=cfg.bootstrap_port if cfg.mode == "prefill" else None)
        return d

    async def _serve_bootstrap(self, host: str) -> None:
        """Serve the bootstrap server, then register this instance's one rank with it."""
        cfg = self.cfg
        table = bootstrap.RankTable()
        app = bootstrap.build_bootstrap_app(table, self.rooms)
        self._server = asyncio.ensure_future(bootstrap.serve(app, self.st.settings.server.host,
                                                             cfg.bootstrap_port, self._shutdown))
        url = f"http://{host}:{cfg.bootstrap_port}/route"
        rank = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
                "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                "rank_ip": host, "rank_port": cfg.bootstrap_port, "page_size": 1,
                "kv_cache_dtype": str(self.engine.kv_dtype).removeprefix("torch."),
                "prefill_http_port": self.st.settings.server.port}
        deadline = time.monotonic() + 10.0
        while True:
            if self._server.done():
                self._server.result()  # the bind failed: raise it
            try:
                (await self.client.put(url, json=rank)).raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._shutdown.set()
        if self._server is not None:
            await self._server
        await self.client.aclose()
        self.transport.close()

    # ------------------------------------------------------------------ a request

    async def begin(self, request, boot: Bootstrap, prompts: list, params: list[SamplingParams]) -> Leg:
        if len(prompts) != 1 or params[0].n != 1:
            raise ApiError(400, "a prefill/decode role serves one prompt and one sample ('n' = 1) per request",
                           param="n" if len(prompts) == 1 else "prompt")
        if self.mode == "prefill":
            p = params[0]
            one = dataclasses.replace(p, max_new_tokens=1, min_new_tokens=min(p.min_new_tokens, 1))
            room = self.rooms.room(boot.room)
            if room.outcome.done():  # the decode side gave it up already
                raise ApiError(502, f"KV transfer to the decode instance failed: {room.outcome.result()['error']}",
                               code="kv_transfer_failed")
            room.claimed = True
            return Leg(self, request, prompts, [one], room)
        prompt = prompts[0]
        ids = self.engine.validate(prompt if isinstance(prompt, str) else None,
                                   None if isinstance(prompt, str) else prompt, params[0])
        first = await self._receive(request, boot, ids)
        return Leg(self, request, [ids], params, first_token=first)

    async def _receive(self, request, boot: Bootstrap, ids: list[int]) -> int | None:
        """Reserve, have the prefill side write ``ids``' KV, cache it (decode side); the
        prefill side's first token."""
        m = self.metrics
        res = core.reserve(self.engine, len(ids))
        if res is None:
            await self._abort(boot, None)  # the prefill side need not wait for us
            m.outcomes.labels(outcome="failed").inc()
            raise ApiError(503, f"no KV room for a {len(ids)}-token prompt; retry later", code="kv_full")
        key, slots = res
        rank = None
        m.waiting.inc()
        t0 = time.perf_counter()
        try:
            rank, out = await _unless_gone(request, self._fetch(boot, slots, len(ids)))
        except BaseException as exc:
            await self._abort(boot, rank)
            core.unreserve(self.engine, key)
            m.outcomes.labels(outcome="failed").inc()
            if isinstance(exc, TransferFailed):
                log.warning("kv transfer failed", room=boot.room, error=str(exc))
                raise ApiError(exc.status, f"KV transfer from the prefill instance failed: {exc}",
                               code="kv_transfer_failed") from exc
            raise
        finally:
            m.waiting.dec()
        core.received(self.engine, key, ids)
        m.bytes.inc(int(out.get("bytes", 0)))
        m.seconds.observe(time.perf_counter() - t0)
        m.outcomes.labels(outcome="success").inc()
        log.debug("kv received", room=boot.room, tokens=len(ids), first_token=out.get("first_token"))
        return out.get("first_token")

    async def _rank(self, boot: Bootstrap) -> str:
        """The prefill rank's address (SGLang's GET /route), retried while not ready."""
        base = f"http://{boot.host}:{boot.port}/route"
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = await self.client.get(base, params=dict.fromkeys(bootstrap.ROUTE_QUERY, -1))
                if r.status_code == 200:
                    info = r.json()
                    if info.get("page_size") != 1 or info.get("dp_size") != 1:
                        raise TransferFailed(502, f"the prefill instance has page size {info.get('page_size')} "
                                                  f"and {info.get('dp_size')} dp ranks; radixd pairs need 1 and 1")
                    r = await self.client.get(base, params=dict.fromkeys(bootstrap.ROUTE_QUERY, 0))
                    if r.status_code == 200:
                        rank = r.json()
                        return f"http://{rank['rank_ip']}:{rank['rank_port']}"
                last = f"{r.status_code} {r.text}"
            except httpx.HTTPError as exc:
                last = str(exc) or type(exc).__name__
            await asyncio.sleep(0.05)
        raise TransferFailed(504, f"the prefill bootstrap server {boot.host}:{boot.port} was not ready within "
                                  f"{self.cfg.bootstrap_timeout_s} s ({last})")

    async def _fetch(self, boot: Bootstrap, slots, n: int) -> tuple[str, dict]:
        """Register with the prefill rank (once), send the slots, follow the reports."""
        rank = await self._rank(boot)
        cfg = self.cfg
        body = {"bootstrap_room": boot.room, "session_id": self.transport.session_id, "slots": slots.tolist(),
                "num_tokens": n}
        silent = 3 * cfg.heartbeat_interval_s
        try:
            async with asyncio.timeout(cfg.transfer_timeout_s):
                for _ in range(2):
                    if rank not in self.registered:
                        (await self.client.post(f"{rank}/kv/register", json={
                            "session_id": self.transport.session_id, "layout": self.layout.to_json()})).raise_for_status()
                        self.registered.add(rank)
                    async with self.client.stream("POST", f"{rank}/kv/transfer", json=body,
                                                  timeout=httpx.Timeout(10.0, read=silent)) as resp:
                        if resp.status_code == 404:  # the prefill instance restarted: register again
                            self.registered.discard(rank)
                            continue
                        resp.raise_for_status()
                        async for text in resp.aiter_lines():
                            msg = json.loads(text) if text else {}
                            if msg.get("state") == "success":
                                return rank, msg
                            if msg.get("state") == "failed":
                                raise TransferFailed(502, msg.get("error", "failed"))
                    raise TransferFailed(502, "the prefill instance ended the transfer without an outcome")
                raise TransferFailed(502, "the prefill instance does not keep this decode instance's registration")
        except TimeoutError:
            raise TransferFailed(504, f"the KV did not arrive within {cfg.transfer_timeout_s} s") from None
        except httpx.ReadTimeout:
            raise TransferFailed(502, f"the prefill instance stopped reporting (no heartbeat for {silent:g} s)") from None
        except httpx.HTTPError as exc:
            raise TransferFailed(502, f"the prefill instance is unreachable ({exc or type(exc).__name__})") from None

    async def _abort(self, boot: Bootstrap, rank: str | None) -> None:
        """Tell the prefill rank to give the room up, waiting for a write under way to end;
        an unreachable rank writes nothing more."""
        try:
            rank = rank or f"http://{boot.host}:{boot.port}"
            await self.client.post(f"{rank}/kv/abort", json={"bootstrap_room": boot.room},
                                   timeout=self.cfg.transfer_timeout_s)
        except httpx.HTTPError:
            pass
