"""The context object every handler reads: ``ServerState`` (no module-global state).

The daemon builds one per process and swaps ``settings`` on SIGHUP; handlers reach it
through ``state_of(request)``. Only the daemon writes ``settings`` and ``draining``; the
gate keeps ``inflight``/``idle``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.requests import Request

from radixd.core.engine import Engine
from radixd.plugins.guard import HookGuard
from radixd.server import protocol, reasoning
from radixd.server.metrics import Metrics
from radixd.server.tool_calls import ToolSupport
from radixd.settings import Settings


@dataclass
class ServerState:
    engine: Engine
    settings: Settings
    model_name: str
    api_keys: list[str]
    plugins: Any
    metrics: Metrics = field(init=False)
    hooks: HookGuard = field(init=False)
    reasoning: Any = field(init=False)  # the reasoning parser chat replies are split by, or None
    tools: ToolSupport = field(init=False)  # the model's tool calling (parser, template)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    log: Any = field(default_factory=lambda: structlog.get_logger("radixd.server"))
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    dashboard: Any = None  # radixd.server.dashboard.Feed when [server] dashboard is on
    disagg: Any = None  # radixd.server.disagg.Disagg in a prefill or decode role

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine, self.model_name)
        p = self.settings.plugins
        self.hooks = HookGuard(self.plugins, on_error=p.on_error, timeout_s=p.hook_timeout_s,
                               on_fault=lambda plugin, hook, kind: self.metrics.plugin_faults.labels(
                                   plugin=plugin, hook=hook, kind=kind).inc())
        self.idle.set()
        self.reasoning = reasoning.choose(self.settings.model.reasoning_parser, reasoning.available(self.plugins),
                                          self.engine.tokenizer)
        m = self.settings.model
        self.tools = ToolSupport.load(self.plugins, m.tool_parser, self.engine.tokenizer, grammar=m.tool_grammar,
                                      max_ws=self.settings.grammar.max_whitespace)

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



def state_of(request: Request) -> ServerState:
    return request.app.state.radixd
