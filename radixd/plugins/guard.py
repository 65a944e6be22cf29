"""``HookGuard``: call the per-request and per-step hooks so that a faulty plugin cannot take
the daemon down with it.

Each implementation is called on its own. One that raises, or returns only after
``plugins.hook_timeout_s``, is a *fault*: logged (plugin, hook, error), counted through
``on_fault`` (the ``radixd_plugin_faults`` metric), then handled per ``plugins.on_error``:

    "fail"     the call raises ``PluginFault`` (the HTTP request it belongs to gets a 500
               error JSON); faults in step hooks, which belong to no request, are logged only
    "disable"  the plugin is unregistered at once; the request goes on without it

A hook that never returns blocks the event loop: no Python code can interrupt it there. The
stall watchdog (``radixd.server.daemon.StallWatch``) sees the loop stop, names the hook
running (``HookGuard.running``), and stops systemd's watchdog pings so the service restarts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pluggy
import structlog

log = structlog.get_logger("radixd.plugins")

ON_ERROR = ("fail", "disable")


class PluginFault(Exception):
    """A plugin's hook implementation failed (with ``plugins.on_error = "fail"``)."""

    def __init__(self, plugin: str, hook: str, reason: str):
        super().__init__(f"plugin {plugin!r} failed in {hook}: {reason}")
        self.plugin = plugin
        self.hook = hook
        self.reason = reason


class HookGuard:
    """Calls hooks of ``pm`` implementation by implementation (in pluggy's order: the last
    registered first), isolating faults as the module docstring says."""

    def __init__(self, pm: pluggy.PluginManager, *, on_error: str = "fail", timeout_s: float = 0.0,
                 on_fault: Callable[[str, str, str], None] | None = None):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.pm = pm
        self.on_error = on_error
        self.timeout_s = timeout_s
        self.on_fault = on_fault
        self.disabled: list[str] = []
        # (plugin, hook, monotonic start) of the implementation running now; read by the
        # stall watchdog's thread to name a hook that hangs
        self.running: tuple[str, str, float] | None = None

    def call(self, hook: str, *, fail: bool = True, **kwargs: Any) -> list[Any]:
        """Call every implementation of ``hook``; return their results (None left out).
        ``fail=False``: a fault never raises (hooks outside any request)."""
        caller = getattr(self.pm.hook, hook)
        results = []
        for impl in reversed(caller.get_hookimpls()):
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                raise PluginFault(impl.plugin_name, hook, "hook wrappers are not supported for this hook")
            name = impl.plugin_name
            t0 = time.monotonic()
            self.running = (name, hook, t0)
            try:
                result = impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:
                self._fault(impl, hook, f"{type(exc).__name__}: {exc}", "error", fail=fail, exc=exc)
                continue
            finally:
                self.running = None
            took = time.monotonic() - t0
            if self.timeout_s and took > self.timeout_s:
                self._fault(impl, hook, f"took {took:.3f} s (plugins.hook_timeout_s = {self.timeout_s})",
                            "timeout", fail=fail)
            if result is not None:
                results.append(result)
        return results

    def _fault(self, impl, hook: str, reason: str, kind: str, *, fail: bool, exc: Exception | None = None) -> None:
        name = impl.plugin_name
        log.error("plugin fault", plugin=name, hook=hook, kind=kind, reason=reason, on_error=self.on_error,
                  exc_info=exc)
        if self.on_fault is not None:
            self.on_fault(name, hook, kind)
        if self.on_error == "disable":
            if self.pm.is_registered(impl.plugin):
                self.pm.unregister(impl.plugin)
                self.disabled.append(name)
                log.warning("plugin disabled", plugin=name, hook=hook)
            return
        if fail:
            raise PluginFault(name, hook, reason) from exc
