"""The scheduler's interface: what the engine's step loop may ask of a scheduler, and when.

Contract
--------
* One scheduler per replica; only that replica's loop (the event-loop thread) calls it, one
  call at a time. The scheduler owns the replica's ``waiting`` and ``running`` lists and,
  through its KV manager, every KV slot, table row and radix-cache lock; nothing else changes
  them.
* A step's life: ``schedule`` builds it (its KV positions count as computed from then on, and
  each request that picks a token gets a placeholder in ``output_ids``); the worker runs it;
  then exactly one of ``process`` (it ran: the picks replace the placeholders) or
  ``rollback`` (it failed: as if it had never been built). Then ``release_finished``.
* Overlap scheduling: at most one step is launched and not yet processed. ``schedule(launched)``
  builds the next step on top of it: its requests' last tokens are placeholders the worker
  fills in on the device from the launched step's picks (``batch.placeholder_src``, set by
  ``schedule``). When that is impossible (KV must be taken back by preemption, or penalties
  need the pending tokens on the host) it returns ``NEED_SYNC``: process the launched step,
  then ask again with ``launched=None``. Requests in a launched step are never released or
  dropped (``inflight``) until it is processed or rolled back.
* ``Request.finish`` is the only writer of ``finish_reason``; the scheduler calls it for
  token-level finishes (stop tokens, length, grammar) and aborts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from radixd.core.forward_batch import ForwardBatch, StepOutput
from radixd.core.request import Request

PLACEHOLDER = -1  # a generated token whose value is still on the device

NEED_SYNC = object()  # schedule(): resolve the launched step first, then ask again


@dataclass
class ScheduledStep:
    batch: ForwardBatch
    reqs: list[Request]          # in batch order
    sampled: list[Request]       # requests that pick a token this step (batch.sample_indices)
    pick_index: list[int] = field(default_factory=list)  # where each pick goes in output_ids
    placeholder_reqs: list[Request] = field(default_factory=list)  # inputs pending on the device
    prompt_lp_reqs: list[tuple[Request, int]] = field(default_factory=list)  # prompt logprobs each gets
    # embedding requests: (request, positions pooled, whether the step completes its prompt),
    # in the order of the worker's pooled rows (``StepOutput.pooled``)
    pool_reqs: list[tuple[Request, int, bool]] = field(default_factory=list)
    step_ms: float = 0.0         # wall time of the step, set by the engine once it ran
    # its replica's worker idle before its launch, and the time since the launch before
    # (``radixd.core.worker_clock``); the replica that ran it
    idle_ms: float = 0.0
    cycle_ms: float = 0.0
    replica: int = 0
    # speculative decoding: each verifying request's drafts (it runs its last token and them,
    # with a pick per position: ``radixd.core.speculative``)
    drafts: dict[Request, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    tier_loaded_tokens: int = 0   # prompt tokens loaded from lower tiers instead of computed


class SchedulerInterface(Protocol):
    """What the engine's replica loop calls (``radixd.core.scheduler.Scheduler`` implements it)."""

    waiting: list[Request]       # admitted in the policy's order; read-only outside the scheduler
    running: list[Request]       # hold a table row and KV; read-only outside the scheduler
    stats: SchedulerStats        # cumulative counters, read by metrics

    def next_arrival(self) -> int:
        """A fresh arrival number for a new request (the engine stamps ``Request.arrival``)."""
        ...

    def add(self, req: Request) -> None:
        """Queue a new request (state WAITING). Called by the engine on submit; the scheduler
        itself re-adds preempted requests, their generated tokens kept."""
        ...

    def abort(self, req: Request) -> None:
        """Mark ``req`` to leave: it is dropped at the next ``schedule`` (or once the step in
        flight that holds it is processed), and then reported by ``take_dropped``. Safe at
        any time; changes nothing else."""
        ...

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        ...

    def schedule(self, launched: ScheduledStep | None = None) -> ScheduledStep | None | object:
        """The next step, ``None`` if nothing can run (with ``launched``: nothing before its
        results are known), or ``NEED_SYNC`` (see the module docstring). Drops aborted
        requests, preempts when decode runs out of KV (never with ``launched``), admits
        waiting requests under the token budget, the running limit and the KV budget, and
        commits the step: KV positions advance, prefill chunks enter the radix cache, each
        sampling request gets a placeholder token."""
        ...

    def process(self, step: ScheduledStep, out: StepOutput) -> list[int]:
        """Put ``out``'s picks in place of ``step``'s placeholders, feed the grammar matchers
        and finish requests that hit a stop token, their length or a complete grammar; add
        the pooled rows to embedding requests, finishing those whose prompt is computed.
        Returns the indices into ``step.sampled`` of the picks that count (a request that
        finished while the step was in flight gets none). Called once per step that ran."""
        ...

    def rollback(self, step: ScheduledStep) -> None:
        """``step`` failed on the worker: undo its KV progress, its cache insertions and its
        placeholders, as if it had never been built. Instead of ``process``."""
        ...

    def release_finished(self, inflight: frozenset[Request] = frozenset()) -> list[Request]:
        """Give back the KV of finished running requests, except those in ``inflight`` (a
        launched step still writes their KV); they leave ``running``, state FINISHED."""
        ...

    def take_dropped(self) -> list[Request]:
        """Requests aborted and removed since the last call (their consumers must be told)."""
        ...

    def fill_masks(self, rows: int, constrained: list[tuple[int, Request]]) -> np.ndarray:
        """[rows, vocab] grammar masks for ``batch.sampling.deferred_masks``: the engine calls
        it once the launched step before is processed (its tokens reached the matchers),
        while this step's forward runs, and resolves ``batch.sampling.allowed_future``."""
        ...

    def accounting(self) -> dict[str, int]:
        """KV slots by owner: total, free, evictable, locked, private."""
        ...

    def check_accounting(self) -> None:
        """Raise AssertionError unless every slot has exactly one owner (between steps)."""
        ...
