"""The daemon process: load the model, bind, serve on the engine's loop, drain on SIGTERM.

    settings -> logging -> plugins -> Engine (weights load) -> bind socket -> hypercorn
    serve + batching loop on one asyncio loop -> READY=1 ... SIGTERM -> STOPPING=1, refuse new
    requests, let running ones finish (drain_timeout_s), abort the rest (their streams end with
    a final event) -> close the server -> exit 0. SIGHUP re-reads the file's live keys.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import socket
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import structlog

from radixd.core.errors import ConfigError
from radixd.core.replica import StepStats
from radixd.logs import configure_logging
from radixd.plugins import make_plugin_manager
from radixd.plugins.wiring import Engine
from radixd.server import reasoning
from radixd.server.app import ServerState, build_app
from radixd.server.dashboard import Feed
from radixd.server.notify import notify, watchdog_interval
from radixd.settings import SECTIONS, Settings, load_settings, section_of

log = structlog.get_logger("radixd.daemon")


async def _maybe_await(results) -> None:
    for r in results or []:
        if inspect.isawaitable(r):
            await r


def bind_socket(host: str, port: int, user_timeout_s: float = 0.0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if user_timeout_s and hasattr(socket, "TCP_USER_TIMEOUT"):
        # inherited by accepted connections: the kernel drops one whose peer leaves sent
        # data unacknowledged (or its window shut) this long, so a client that never reads
        # cannot pin a connection after its response was ended
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(user_timeout_s * 1000))
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class Daemon:
    def __init__(self, settings: Settings, config_path: str | None, overrides: dict[str, Any] | None = None):
        self.settings = settings
        self.config_path = config_path
        self.overrides = overrides or {}  # the launch flags: they win over the file on reload too
        self.shutdown = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> int:
        s = self.settings
        pm = make_plugin_manager(load_entry_points=s.plugins.entry_points, allow=s.plugins.allow or None,
                                 block=s.plugins.block)
        api_keys = s.api_keys()  # a bad key file is refused before the model loads
        reasoning.check_setting(s.model.reasoning_parser, reasoning.available(pm))  # and a misspelt parser
        t0 = time.perf_counter()
        engine = await asyncio.to_thread(Engine, s.engine_config(), plugin_manager=pm)
        name = s.model.served_name or _default_name(engine)
        self.state = st = ServerState(engine=engine, settings=s, model_name=name, api_keys=api_keys, plugins=pm)
        if s.server.dashboard:
            st.dashboard = Feed()
        engine.stats_hook = self._on_step
        app = build_app(st)
        await engine.start()
        if s.disaggregation.mode != "off":  # (its imports are a PD role's: colocated never loads them)
            from radixd.server.disagg import Disagg

            st.disagg = await Disagg.start(st, pm)
        await _maybe_await(pm.hook.radixd_startup(state=st))

        from hypercorn.asyncio import serve
        from hypercorn.config import Config as HyperConfig

        sock = bind_socket(s.server.host, s.server.port, user_timeout_s=2 * s.server.send_timeout_s + 5)
        port = sock.getsockname()[1]
        hc = HyperConfig()
        hc.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) the socket from here
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")  # rendered by our handler, once
        hc.graceful_timeout = 1.0
        hc.keep_alive_timeout = 5.0
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.begin_drain, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self.begin_drain, "SIGINT")
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        server = self._spawn(serve(app, hc, shutdown_trigger=self.shutdown.wait))
        log.info("listening", host=s.server.host, port=port, model=name, device=str(engine.device),
                 kv_slots=engine.allocator.total, load_s=round(time.perf_counter() - t0, 2))
        notify(f"READY=1\nSTATUS=serving {name} on {s.server.host}:{port}\nMAINPID={_pid()}")
        watch = StallWatch(st, loop, ping_every=watchdog_interval() if s.server.watchdog else None)
        watch.start()
        try:
            await server
        finally:
            watch.stop()
        await _maybe_await(pm.hook.radixd_shutdown(state=st))
        if st.disagg is not None:
            await st.disagg.stop()
        await engine.stop()
        log.info("stopped")
        return 0

    def _on_step(self, stats: StepStats) -> None:
        if self.state.dashboard is not None:
            self.state.dashboard.record(stats)
        self.state.hooks.call("radixd_step_stats", fail=False, stats=stats._asdict())

    # ------------------------------------------------------------------ signals

    def begin_drain(self, why: str) -> None:
        if self.state.draining:
            return
        self._spawn(self._drain(why))

    async def _drain(self, why: str) -> None:
        st = self.state
        st.draining = True
        notify("STOPPING=1")
        timeout = st.settings.server.drain_timeout_s
        log.info("draining", signal=why, inflight=st.engine.num_inflight, timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while st.engine.num_inflight and time.monotonic() < deadline:
            # the engine's queue empties as requests finish; wait on the gate's idle event
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await st.idle.wait()
            except TimeoutError:
                break
            if st.engine.num_inflight:
                await asyncio.sleep(0.01)
        aborted = st.engine.abort_all()
        if aborted:
            log.warning("drain timeout: aborted requests", count=aborted)
            try:  # let the aborted streams write their final event
                async with asyncio.timeout(2.0):
                    await st.idle.wait()
            except TimeoutError:
                pass
        self.shutdown.set()

    def reload(self) -> None:
        """SIGHUP: re-read the file; apply the live keys, report the others."""
        if not self.config_path:
            log.warning("reload: started without --config; nothing to reload")
            return
        try:
            new = load_settings(self.config_path, self.overrides)
        except ConfigError as exc:
            log.error("reload refused; keeping the running configuration", error=str(exc))
            return
        old = self.settings
        merged = {}
        pending = []
        for sec in SECTIONS:
            o, n = section_of(old, sec), section_of(new, sec)
            changes = {}
            for f in fields(o):
                if getattr(o, f.name) != getattr(n, f.name):
                    if f.metadata.get("live"):
                        changes[f.name] = getattr(n, f.name)
                    else:
                        pending.append(f"{sec}.{f.name}")
            merged[sec.replace(".", "_")] = replace(o, **changes) if changes else o
        self.settings = replace(old, **merged)
        self.state.settings = self.settings
        lg = self.settings.logging
        configure_logging(lg.level, lg.format)
        log.info("reloaded", needs_restart=pending or None)
        notify("STATUS=reloaded")



class StallWatch:
    """A thread that watches the batching loop and, while it is healthy, pings systemd's
    watchdog (``WATCHDOG=1``) every ``ping_every`` seconds.

    Stalled means: a batching step running longer than ``server.stall_timeout_s`` (a hung
    forward pass or hook; ``/health`` then answers 503), the event loop itself blocked that
    long (its heartbeat stops; nothing on the loop can answer then), or the batching loop
    ended. The pings stop while it is stalled, so systemd restarts the service once
    ``WatchdogSec`` passes. It runs in its own thread because the loop may be the thing stuck.
    """

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop, ping_every: float | None):
        self.state = state
        self.loop = loop
        self.ping_every = ping_every
        self.beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixd-stall-watch", daemon=True)
        self._handle: asyncio.TimerHandle | None = None
        self.stalled_reason: str | None = None

    def start(self) -> None:
        self._heartbeat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        self._thread.join()

    def _tick(self) -> float:
        limit = self.state.settings.server.stall_timeout_s or 5.0
        return min(self.ping_every or limit, limit) / 4

    def _heartbeat(self) -> None:
        self.beat = time.monotonic()
        self._handle = self.loop.call_later(self._tick(), self._heartbeat)

    def check(self) -> str | None:
        st = self.state
        limit = st.settings.server.stall_timeout_s
        blocked = time.monotonic() - self.beat
        if limit and blocked > limit:
            running = st.hooks.running
            where = f" in plugin {running[0]!r} hook {running[1]}" if running else ""
            return f"event loop blocked for {blocked:.1f} s{where} (server.stall_timeout_s = {limit})"
        return st.stalled()

    def _run(self) -> None:
        last_ping = 0.0
        while not self._stop.wait(self._tick()):
            reason = self.check()
            if reason != self.stalled_reason:
                if reason:
                    log.error("batching loop stalled; watchdog pings stop", reason=reason)
                else:
                    log.warning("batching loop running again; watchdog pings resume")
                self.stalled_reason = reason
            now = time.monotonic()
            if reason is None and self.ping_every and now - last_ping >= self.ping_every:
                notify("WATCHDOG=1")
                last_ping = now


def _pid() -> int:
    import os

    return os.getpid()


def _default_name(engine: Engine) -> str:
    from radixd.core.model_loader import DEFAULT_NAME

    if engine.config.model == "default":
        return DEFAULT_NAME
    return Path(engine.config.model).name.removesuffix(".gguf")


def serve_forever(config_path: str | None, overrides: dict[str, Any] | None = None) -> int:
    """Serve until SIGTERM; ``overrides``: ``{"section.key": value}`` laid over the file."""
    settings = load_settings(config_path, overrides)
    configure_logging(settings.logging.level, settings.logging.format)
    return asyncio.run(Daemon(settings, config_path, overrides).run())
