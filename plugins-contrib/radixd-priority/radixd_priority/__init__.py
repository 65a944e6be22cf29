"""radixd-priority: a ``priority`` scheduling policy for radixd.

Waiting requests are admitted highest ``priority`` first (the integer a client sends with
its request; larger is more urgent, default 0). Ties go to the request with the longest
prefix already in the radix cache, then to the earliest arrival.

Aging keeps low priorities from starving: a request's effective priority grows by 1 for
every ``RADIXD_PRIORITY_AGING_STEPS`` scheduling calls it has spent waiting (a scheduling
call is one batching step in which the scheduler asks the policy to rank the waiting
queue). The variable is read when an engine creates the policy; unset or empty means
``DEFAULT_AGING_STEPS``, ``0`` turns aging off (strict priority), anything that is not a
whole number >= 0 is refused with a ``ConfigError`` naming the variable.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping

from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.policy import PolicyContext
from radixd.core.request import Request
from radixd.plugins import hookimpl

__version__ = "0.1.0"
__all__ = ["AGING_ENV", "DEFAULT_AGING_STEPS", "PriorityPolicy", "aging_steps_from_env"]

AGING_ENV = "RADIXD_PRIORITY_AGING_STEPS"
DEFAULT_AGING_STEPS = 100
# Beyond this many waiting requests, ties are broken by arrival only: peeking the cache for
# every request each step would cost too much (the built-in lpm policy uses the same bound).
PEEK_MAX_QUEUE = 128


def aging_steps_from_env(environ: Mapping[str, str] | None = None) -> int:
    """Scheduling calls per +1 of effective priority, from ``RADIXD_PRIORITY_AGING_STEPS``."""
    env = os.environ if environ is None else environ
    raw = env.get(AGING_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_AGING_STEPS
    if not re.fullmatch(r"[0-9]+", raw.strip()):
        raise ConfigError(AGING_ENV, raw,
                          f"a whole number >= 0 in the environment variable {AGING_ENV} "
                          f"(scheduling steps per priority level; 0 disables aging; "
                          f"unset: {DEFAULT_AGING_STEPS})")
    return int(raw.strip())


class PriorityPolicy:
    """Highest (aged) priority first; then longest cached prefix; then arrival."""

    name = "priority"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.aging_steps = aging_steps_from_env()
        self._calls = 0
        # id(request) -> (request, call at which it was first seen waiting). The request is
        # kept so its id cannot be reused while the entry lives; entries of requests that
        # left the queue are dropped on the next call.
        self._first_seen: dict[int, tuple[Request, int]] = {}

    def effective_priority(self, r: Request) -> int:
        """``r.priority`` plus its aging bonus as of the latest ``order`` call."""
        if self.aging_steps <= 0:
            return r.priority
        entry = self._first_seen.get(id(r))
        if entry is None or entry[0] is not r:
            return r.priority
        return r.priority + (self._calls - entry[1]) // self.aging_steps

    def order(self, waiting: list[Request], ctx: PolicyContext) -> list[Request]:
        self._calls += 1
        if self.aging_steps > 0:
            seen: dict[int, tuple[Request, int]] = {}
            for r in waiting:
                entry = self._first_seen.get(id(r))
                first = entry[1] if entry is not None and entry[0] is r else self._calls
                seen[id(r)] = (r, first)
            self._first_seen = seen
        eff = {id(r): self.effective_priority(r) for r in waiting}
        # Only requests that share their effective priority need the cache peeked.
        tied = Counter(eff.values())
        peek = len(waiting) <= PEEK_MAX_QUEUE

        def key(r: Request) -> tuple[int, int, int]:
            e = eff[id(r)]
            hit = ctx.cache.peek_prefix_len(r.seq, r.namespace) if peek and tied[e] > 1 else 0
            return (-e, -hit, r.arrival)

        return sorted(waiting, key=key)


@hookimpl
def radixd_schedule_policies():
    return {"priority": PriorityPolicy}
