"""One model copy and its batching loop: the worker (and its thread), KV slots, radix tree,
scheduler and tiers of one replica; ``step()`` is one turn of the loop.

    step():  schedule the next batch (given the step still on the device)
             -> end the streams of requests the scheduler dropped
             -> launch the batch on the worker thread
             -> finish the step launched before it while the new one runs:
                read its picks -> Scheduler.process -> Outputs.emit -> release finished
             (without overlap scheduling the new step is finished at once)

Deferred grammar masks are an option of the launch: the worker waits for them before it
samples, so the step before is read on the reader thread and its tokens reach the matchers
meanwhile. A failed forward pass (``launch`` or ``resolve`` raising) fails that step's
requests in one place (``_fail``: roll back, abort, end their streams), never the loop; any
other failure of a step fails everything the replica holds (``_fail_all``).

Contract: everything here runs on the event loop's thread except the worker's ``launch`` and
``resolve``. The engine owns the replicas; a replica owns its worker, scheduler and KV.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from radixd.core.config import EngineConfig
from radixd.core.kv_events import Publisher, Recorder
from radixd.core.kv_pool import RowAllocator
from radixd.core.outputs import Outputs
from radixd.core.policy import SchedulePolicy
from radixd.core.sampler import SampledTokens
from radixd.core.scheduler import NEED_SYNC, ScheduledStep, Scheduler
from radixd.core.speculative.drafter import Drafter, ReadsTarget
from radixd.core.swa_cache import slots_and_cache
from radixd.core.tiers.hierarchy import KVHierarchy
from radixd.core.worker import Worker, bind_device
from radixd.core.worker_clock import WorkerClock

log = logging.getLogger("radixd.engine")


class StepStats(NamedTuple):
    """What one batching step did (``Engine.stats_hook``, the ``radixd_step_stats`` hook)."""

    batch_size: int        # requests in the batch
    prefill_tokens: int    # prompt tokens of requests computing more than one
    decode_tokens: int     # the other tokens (one per decoding request)
    running: int           # requests running after the step, over all replicas
    waiting: int           # requests waiting for admission, over all replicas
    kv_usage: float        # share of KV slots not free, over all replicas (0..1)
    step_ms: float         # the step's wall time, launch to release
    idle_ms: float         # its replica's worker idle before its launch (radixd.core.worker_clock)
    cycle_ms: float        # from that replica's launch before (or its wake) to this one's
    replica: int           # the data-parallel replica that ran it

    @classmethod
    def of(cls, step: ScheduledStep, *, running: int, waiting: int, kv_usage: float) -> StepStats:
        b = step.batch
        prefill = sum(n for n in b.extend_lens if n > 1)
        return cls(b.batch_size, prefill, b.num_tokens - prefill, running, waiting, kv_usage, step.step_ms,
                   step.idle_ms, step.cycle_ms, step.replica)


class Launched(NamedTuple):
    """A step on the device whose picks are not read yet."""

    step: ScheduledStep
    picks: SampledTokens | None
    t0: float  # perf_counter at its launch


class Replica:
    """One model copy (see the module docstring). ``on_step(step)``: called after each step
    is finished (its outputs emitted); ``drafter(config, cache)``: makes its drafter (None:
    no speculative decoding)."""

    def __init__(self, index: int, worker: Worker, config: EngineConfig, policy: SchedulePolicy, *,
                 outputs: Outputs, reader: concurrent.futures.Executor, on_step: Callable[[ScheduledStep], None],
                 eos_token_ids: tuple[int, ...], context_len: int, tiers: KVHierarchy | None = None,
                 vocab_size: int | None = None, drafter: Callable[..., Drafter] | None = None):
        self.index = index
        self.worker = worker
        self.allocator, self.cache = slots_and_cache(worker.pool, enabled=config.radix_cache)
        self.rows = RowAllocator(config.max_running_requests)
        self.kv_events = None  # kv_events.Publisher of this replica's cache changes ([kv_events])
        if config.kv_events:
            self.kv_events = Publisher(config.kv_events_endpoint, config.kv_events_topic,
                                       dp_rank=index)
            self.cache.listener = Recorder(config.kv_events_block_size, self.kv_events)
        self.policy = policy
        self.tiers = tiers  # KVHierarchy over this replica's pool, or None
        made = drafter(config, self.cache) if drafter is not None else None
        if isinstance(made, ReadsTarget):
            made.attach(worker)
        self.scheduler = Scheduler(config, allocator=self.allocator, rows=self.rows, cache=self.cache,
                                   policy=policy, eos_token_ids=eos_token_ids, context_len=context_len,
                                   tiers=tiers, vocab_size=vocab_size, cascade_members=worker.cascade_members,
                                   drafter=made)
        self.outputs = outputs
        self.overlap = config.overlap_schedule
        device = worker.device
        self.executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"radixd-worker-{device}", initializer=bind_device, initargs=(device,))
        self.executor.submit(worker.warm_up).result()  # (on the thread that will run the steps)
        self.reader = reader  # reads a step's picks while the worker waits for grammar masks
        self.on_step = on_step
        self.inflight: Launched | None = None
        self.clock = WorkerClock()  # the worker's idle gaps, noted on each step
        # monotonic time the step now running began (None between steps): read by the
        # stall watchdog (another thread) and /health
        self.step_started: float | None = None
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.stopping = False

    @property
    def load(self) -> int:
        """Requests waiting or running here (what the router balances)."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ life

    def start(self, name: str) -> None:
        self.stopping = False
        self.wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self.run(), name=name)

    async def stop(self) -> None:
        """End the loop once nothing is left to do (the engine aborted what was running)."""
        self.stopping = True
        if self.task is not None:
            self.wake.set()
            await self.task
            self.task = None

    def close(self) -> None:
        """After ``stop``: the worker thread ends, queued tier writes are handed over."""
        self.executor.shutdown(wait=True)
        self.worker.close()
        if self.tiers is not None:
            self.tiers.close(close_tiers=False)  # the engine closes the shared tiers after
        if self.kv_events is not None:
            self.kv_events.close()

    async def run(self) -> None:
        """The batching loop. A failure of one step fails the requests in flight, never the
        loop itself (a dead loop would leave every caller waiting forever)."""
        while True:
            try:
                if not await self.step():
                    return
            except Exception as exc:
                log.exception("batching step failed; failing the requests in flight")
                self._fail_all(exc)

    # ------------------------------------------------------------------ one turn

    async def step(self) -> bool:
        """Schedule and launch one batch, then finish the one launched before it (overlap:
        the device runs step N+1 while the loop reads step N's picks and streams them).
        False when the engine has stopped."""
        prev = self.inflight
        step = self.scheduler.schedule(prev.step if prev else None)
        self.outputs.drop(self.scheduler.take_dropped())
        if step is None and prev is None:
            if self.stopping:
                return False
            self.wake.clear()
            await self.wake.wait()
            self.clock.woke()
            return True
        self.step_started = time.monotonic()
        try:
            if step is NEED_SYNC or step is None:  # nothing to launch before prev is read
                self.inflight = None
                await self._finish(prev, frozenset())
            else:
                await self._launch(step, prev)
        finally:
            self.step_started = None
        return True

    async def _launch(self, step: ScheduledStep, prev: Launched | None) -> None:
        """Launch ``step``, then finish ``prev`` while it runs (without overlap scheduling,
        finish ``step`` too). With deferred grammar masks ``prev`` is finished while the
        worker waits for them, and they are filled from its tokens."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        sb = step.batch.sampling
        deferred = sb is not None and sb.allowed_future is not None
        step.replica = self.index
        launching = loop.run_in_executor(self.executor, self.clock.launch, step, self.worker.launch, step.batch,
                                         prev.picks if prev is not None else None)
        if deferred:
            self.inflight = None
            try:
                await self._finish(prev, frozenset(step.reqs), self.reader)
                sb.allowed_future.set_result(torch.from_numpy(
                    self.scheduler.fill_masks(len(step.sampled), sb.deferred_masks)))
            finally:
                if not sb.allowed_future.done():  # never leave the worker waiting
                    sb.allowed_future.set_exception(RuntimeError("grammar masks were not computed"))
        try:
            picks = await launching
        except Exception as exc:  # a failed forward fails its requests, not the engine
            self._fail(step, exc)
            return
        launched = self.inflight = Launched(step, picks, t0)
        if prev is not None and not deferred:
            await self._finish(prev, frozenset(step.reqs))
        if not self.overlap:
            self.inflight = None
            await self._finish(launched, frozenset())

    async def _finish(self, launched: Launched, inflight: frozenset,
                      reader: concurrent.futures.Executor | None = None) -> None:
        """Read a launched step's picks, stream them, release what finished (not the
        requests of ``inflight``, the step launched after it)."""
        step = launched.step
        try:
            out = await asyncio.get_running_loop().run_in_executor(reader or self.executor, self.clock.resolve,
                                                                   self.worker.resolve, launched.picks)
        except Exception as exc:
            self._fail(step, exc)
            return
        accepted = self.scheduler.process(step, out)
        self.outputs.emit(step, out, accepted)
        self.outputs.release(self.scheduler.release_finished(inflight))
        step.step_ms = (time.perf_counter() - launched.t0) * 1000
        self.on_step(step)

    # ------------------------------------------------------------------ failures

    def _fail(self, step: ScheduledStep, exc: Exception) -> None:
        """The step's forward pass failed (called where it was caught): forget what it
        would have computed and fail its requests."""
        log.exception("forward pass failed; failing %d requests", len(step.reqs))
        self.scheduler.rollback(step)
        for r in step.reqs:
            self.scheduler.abort(r)
        self.outputs.fail(step.reqs, f"forward pass failed: {exc}")

    def _fail_all(self, exc: Exception) -> None:
        """A step failed outside the forward pass: fail what this replica holds."""
        if self.inflight is not None:
            self.scheduler.rollback(self.inflight.step)
            self.inflight = None
        held = [*self.scheduler.waiting, *self.scheduler.running]
        for r in held:
            self.scheduler.abort(r)
        self.outputs.fail(held, f"engine step failed: {exc!r}")

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict:
        acc = self.scheduler.accounting()
        cache, st = self.cache, self.scheduler.stats
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv": acc,
            "kv_usage": 1.0 - acc["free"] / acc["total"],
            "cache_queried_tokens": cache.queried_tokens,
            "cache_hit_tokens": cache.hit_tokens,
            "cache_hit_rate": cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0,
            "preemptions": st.preemptions,
            "steps": st.steps,
            "prefill_tokens": st.prefill_tokens,
            "decode_tokens": st.decode_tokens,
            "tier_loaded_tokens": st.tier_loaded_tokens,
            **(spec.stats.as_dict() if (spec := self.scheduler.speculator) is not None else {}),
        }
