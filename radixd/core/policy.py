"""Scheduling policies decide the order in which waiting requests are admitted.

A policy is a plain object created once per engine (through the
``radixd_schedule_policies`` hook) and called once per scheduling step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from radixd.core.config import EngineConfig
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Request


@dataclass
class PolicyContext:
    cache: RadixCache
    # Requests admitted earlier whose prompt is still being prefilled (chunked): their
    # uncomputed tokens will be in the cache soon.
    prefilling: list[Request]


class SchedulePolicy(Protocol):
    name: str

    def __init__(self, config: EngineConfig) -> None: ...

    def order(self, waiting: list[Request], ctx: PolicyContext) -> Iterable[Request]:
        """Return the waiting requests to try this step, best first.

        Requests left out stay waiting. The scheduler admits them in the returned order
        until a budget runs out, so the list may be a prefix of the queue; an iterator is
        read only that far.
        """
        ...
