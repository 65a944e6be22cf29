"""When a replica's worker sits idle: the gap before each step's launch.

The replica runs its worker's ``launch`` and ``resolve`` through ``WorkerClock``, which reads
the monotonic clock three times a step (a launch's start and end, a resolve's end) and notes
on each launched ``ScheduledStep``:

    idle_ms   from the end of the worker's last call to this launch's start
    cycle_ms  from the launch before (its start) to this launch's start: idle_ms plus the
              worker's time on the calls in between

so ``sum(idle_ms) / sum(cycle_ms)`` over a run of steps is the share of its time the worker
sat idle. Time the replica had nothing to do is not idle: after it wakes from rest (``woke``)
the gaps count from the wake (a quiet minute would otherwise read as a minute of idle
device before the next step). "As the worker sees it": on a GPU a launch only queues the
work, so while the worker waits the device may still be running the step before.

Contract: ``launch`` runs on the replica's worker thread and ``resolve`` on the thread the
replica reads picks on (the worker thread, or the engine's reader thread while a launch
waits for grammar masks; its resolve ends before that launch does); ``woke`` runs on the
event loop while nothing is in flight. Each writes whole floats only, and the replica reads a
step's fields after its launch returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixd.core.scheduler_interface import ScheduledStep


class WorkerClock:
    """One replica's worker calls, timed (see the module docstring)."""

    def __init__(self) -> None:
        self._free: float | None = None     # monotonic time the worker's last call ended
        self._started: float | None = None  # ... the last launch started (or the wake)

    def woke(self) -> None:
        self._free = self._started = time.monotonic()

    def launch(self, step: ScheduledStep, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)``, the worker's launch of ``step``, noting the gap before it."""
        start = time.monotonic()
        if self._free is not None:
            step.idle_ms = max(0.0, start - self._free) * 1000
            step.cycle_ms = (start - self._started) * 1000
        self._started = start
        try:
            return fn(*args)
        finally:
            self._free = time.monotonic()

    def resolve(self, fn: Callable[..., Any], *args) -> Any:
        try:
            return fn(*args)
        finally:
            self._free = time.monotonic()
