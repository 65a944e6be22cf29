"""``Engine``: the Python API over one model, a facade over its replicas.

    submit() -> validate + tokenize -> Router.pick (dp_size > 1) -> Outputs.open +
    Scheduler.add -> [the replica's loop: Replica.step] -> Outputs -> Submission -> caller

The engine's one concern is the calls: configuration, admission of a call (validation, the
replica, its requests and streams), abort, start and stop, and what it reports (stats, load,
health). It is built from ready parts: ``assembly`` describes the model and makes the workers,
a policy factory makes each replica's scheduling policy, and the cache tiers and grammar
compiler come made (``radixd.plugins.wiring`` makes them from plugins; ``radixd.Engine``).
Everything but the forward pass runs on the event loop's thread; worker threads only compute.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from radixd.core import gc_control
from radixd.core.assembly import (
    ModelSetup,
    make_worker,
    mixed_steps,
    mixed_uncaptured,
    replica_devices,
)
from radixd.core.calls import Calls
from radixd.core.config import EngineConfig
from radixd.core.errors import EngineStopped, InvalidRequest
from radixd.core.kv_pool import RowAllocator, SlotAllocator
from radixd.core.outputs import GenerateOutput, Outputs, Submission, TokenLogprob
from radixd.core.policy import SchedulePolicy
from radixd.core.radix_cache import RadixCache
from radixd.core.replica import Replica, StepStats
from radixd.core.router import Router
from radixd.core.sampling_params import SamplingParams
from radixd.core.scheduler import ScheduledStep, Scheduler
from radixd.core.speculative.drafter import Drafter, reads_target
from radixd.core.tiers import CacheTier
from radixd.core.tiers.hierarchy import KVHierarchy
from radixd.core.worker import Worker

__all__ = ["Engine", "GenerateOutput", "GrammarCompiler", "StepStats", "Submission", "TokenLogprob"]

log = logging.getLogger("radixd.engine")
EMBED = SamplingParams(max_new_tokens=0)  # an embedding request's: it generates nothing


class GrammarCompiler(Protocol):
    """Compiles a request's constraint (``SamplingParams.constraint``: kind, spec, after) for
    this engine's tokenizer. ``get`` raises ``InvalidRequest`` naming the field for a constraint
    that does not compile (HTTP 400); the compiled object's ``matcher()`` gives one matcher
    per sample (the contract in ``radixd.grammars``)."""

    async def get(self, kind: str, spec: str, after: str | None = None): ...

    def cached(self, kind: str, spec: str, after: str | None = None):
        """The compiled grammar if it is at hand, else None (no compile)."""

    def shutdown(self) -> None: ...


class Engine:
    """Serve one model: ``async for out in engine.generate("Hi", params=...)``.

    The engine starts its batching loop on first use (or ``await engine.start()``) on the
    running event loop; ``await engine.stop()`` ends it. ``policy(config)`` makes each
    replica's scheduling policy; ``tiers``: the lower cache tiers, fastest first, shared by
    the replicas (the engine closes them); ``grammars``: None refuses constrained requests;
    ``drafter(config, cache)`` makes each replica's drafter (None: no speculative decoding)."""

    def __init__(self, config: EngineConfig, *, policy: Callable[[EngineConfig], SchedulePolicy],
                 tiers: Sequence[CacheTier] = (), grammars: GrammarCompiler | None = None,
                 setup: ModelSetup | None = None, drafter: Callable[..., Drafter] | None = None):
        setup = setup or ModelSetup.load(config)
        self.dtype, self.model_path, self.model_cfg = setup.dtype, setup.path, setup.cfg
        self.kv_dtype = setup.kv_format.dtype  # what the KV pool holds (kv_cache_dtype)
        self.tokenizer = setup.tokenizer  # None: token ids in and out only
        self.context_len, self.eos_token_ids = setup.context_len, setup.eos_token_ids
        self.pooling = setup.pooling  # an embedding engine's (core.pooling); None: it generates
        self.cache_tiers = list(tiers)  # shared by the replicas (content keys name any)
        self.grammars = grammars
        self.outputs = Outputs(tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                               stream_interval=config.stream_interval, abort=self._abort)
        # reads a step's picks while the worker thread waits for its grammar masks
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixd-reader")
        self.replicas: list[Replica] = []
        # (a drafter that reads the model's hidden states: which layers', before any weights load)
        aux = drafter.target_layers(config, self.model_cfg) if reads_target(drafter) else ()
        self.config = mixed_steps(config, setup, aux)  # (the mixed steps' budget settled)
        for d in range(config.dp_size):
            worker = make_worker(self.config, setup, replica_devices(setup.device, d, config.dp_size, config.tp_size),
                                 aux_layers=aux)
            rc = mixed_uncaptured(config, self.config, worker)
            self.replicas.append(Replica(d, worker, rc, policy(rc), outputs=self.outputs, reader=self._reader,
                                         on_step=self._stepped, eos_token_ids=self.eos_token_ids,
                                         context_len=self.context_len, tiers=self._hierarchy(worker),
                                         vocab_size=self.model_cfg.vocab_size, drafter=drafter))
        self.device = self.replicas[0].worker.device
        self.router = None
        if config.dp_size > 1:
            self.router = Router(config.dp_size, policy=config.routing,
                                 balance_threshold=config.routing_balance_threshold,
                                 balance_ratio=config.routing_balance_ratio,
                                 capacity_tokens=self.replicas[0].allocator.total,
                                 loads=lambda: [rep.load for rep in self.replicas])
        self._calls = Calls(config, tokenizer=self.tokenizer, vocab_size=self.model_cfg.vocab_size,
                            context_len=self.context_len, pool_slots=self.replicas[0].allocator.total,
                            pooling=self.pooling)
        self._started = False
        self._stopping = False
        self.step_hook: Callable[[ScheduledStep], None] | None = None  # for tests and statistics
        self.stats_hook: Callable[[StepStats], None] | None = None  # each step's StepStats

    def _hierarchy(self, worker: Worker) -> KVHierarchy | None:
        """A ``KVHierarchy`` over ``worker``'s pool and the shared tiers (None without)."""
        if not self.cache_tiers:
            return None
        c = self.config
        return KVHierarchy(self.cache_tiers, pool=worker.pool, page_tokens=c.cache_page_tokens,
                           identity=self.cache_tiers[0].ctx.identity, write_policy=c.cache_write_policy,
                           write_hits=c.cache_write_hits, prefetch=c.cache_prefetch)

    # The first replica's parts (the only ones with dp_size = 1).
    @property
    def worker(self) -> Worker:
        return self.replicas[0].worker

    @property
    def scheduler(self) -> Scheduler:
        return self.replicas[0].scheduler

    @property
    def cache(self) -> RadixCache:
        return self.replicas[0].cache

    @property
    def allocator(self) -> SlotAllocator:
        return self.replicas[0].allocator

    @property
    def rows(self) -> RowAllocator:
        return self.replicas[0].rows

    @property
    def policy(self) -> SchedulePolicy:
        return self.replicas[0].policy

    @property
    def tiers(self) -> KVHierarchy | None:
        """The first replica's ``KVHierarchy`` (None without ``cache_tiers``)."""
        return self.replicas[0].tiers

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            self._stopping = False
            gc_control.acquire(freeze=self.config.gc_freeze, threshold=self.config.gc_threshold)
            for rep in self.replicas:
                rep.start("radixd-batching-loop" + (f"-{rep.index}" if len(self.replicas) > 1 else ""))

    async def stop(self) -> None:
        """Abort everything in flight and end the batching loops."""
        self._stopping = True
        for reqs in list(self.outputs.by_rid.values()):
            for r in reqs:
                r.aborted = True
        for rep in self.replicas:
            await rep.stop()
        if self._started:
            gc_control.release()
        self._started = False
        for rep in self.replicas:  # queued writes reach the tiers, then the tiers close
            rep.close()
        for tier in self.cache_tiers:
            tier.close()
        self._reader.shutdown(wait=True)
        if self.grammars is not None:
            self.grammars.shutdown()

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _stepped(self, step: ScheduledStep) -> None:  # the hooks (failures logged, not raised)
        if self.step_hook is not None:
            try:
                self.step_hook(step)
            except Exception:
                log.exception("step hook failed")
        if self.stats_hook is not None:
            try:
                self.stats_hook(StepStats.of(step, running=self.num_running, waiting=self.num_waiting,
                                             kv_usage=self.kv_usage()))
            except Exception:
                log.exception("stats hook failed")

    # ------------------------------------------------------------------ requests

    async def compile_grammar(self, params: SamplingParams):
        """Compile (or fetch from the cache) the request's constraint off the event loop;
        None if it has none. Raises ``InvalidRequest`` naming the field (HTTP 400)."""
        c = params.constraint
        if c is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(c[0], "grammar constraints need a tokenizer; this engine runs without one")
        return await self.grammars.get(*c)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kw) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # a dict or a BatchEncoding

    def validate(self, prompt: str | None, input_ids: Sequence[int] | None, params: SamplingParams) -> list[int]:
        """Check a request; return its prompt token ids. Raises ``InvalidRequest``."""
        return self._calls.check(prompt, input_ids, params)

    def submit(self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None,
               params: SamplingParams | dict | None = None, rid: str | None = None, priority: int = 0,
               max_unread: int = 0, grammar=None) -> Submission:
        """Validate and queue one call now; iterate the returned ``Submission`` for outputs.

        Raises ``InvalidRequest`` (naming the field) or ``EngineStopped`` at once, before any
        output, so front ends can answer with an error status. Must be called on the loop.
        ``max_unread`` > 0: once more than that many outputs wait unread (a consumer that
        stopped reading), the call is aborted and its KV freed.
        A constrained request needs its grammar compiled first: pass ``grammar`` from
        ``await compile_grammar(params)`` (``generate`` does this itself).
        """
        if isinstance(params, dict):
            params = SamplingParams(**params)
        params = params or SamplingParams()
        ids = self.validate(prompt, input_ids, params)
        return self._queue(ids, self._calls.fitted(params, len(ids)), rid, priority, max_unread, grammar)

    def embed(self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None, rid: str | None = None,
              priority: int = 0, max_unread: int = 0) -> Submission:
        """Queue one embedding call (an engine with ``pooling``): its prompt is prefilled, batched
        with the others and sharing cached prefixes, its final hidden states pooled instead of
        a token sampled; its one output carries ``embedding``. Raises as ``submit`` does."""
        return self._queue(self._calls.check_embed(prompt, input_ids), EMBED, rid, priority, max_unread, None)

    def _queue(self, ids: list[int], params: SamplingParams, rid: str | None, priority: int, max_unread: int,
               grammar) -> Submission:
        """A checked call's requests onto a replica, each with its stream."""
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        rid = rid or uuid.uuid4().hex
        if rid in self.outputs.by_rid:
            raise InvalidRequest("rid", f"a request with id {rid!r} is already running")
        self._ensure_started()
        if params.max_new_tokens == 0 and self.pooling is None:  # (an embedding call generates nothing)
            return self.outputs.empty(rid, params.n, len(ids))
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("priority", f"must be an integer, got {priority!r}")
        c = params.constraint
        if c is not None:
            if grammar is None and self.grammars is not None:
                grammar = self.grammars.cached(*c)
            if grammar is None:
                raise InvalidRequest(c[0], "the constraint is not compiled: await Engine.compile_grammar(params) "
                                           "and pass it as grammar=")
        rep = self.replicas[0] if self.router is None else self.replicas[self.router.pick(ids)]
        reqs = self._calls.requests(rid, ids, params, namespace=rep.cache.default_namespace(),
                                    arrival=rep.scheduler.next_arrival)
        if grammar is not None:
            for r in reqs:
                r.matcher = grammar.matcher()  # one per sample
        sub = self.outputs.open(rid, reqs, params, ids, max_unread)
        sub.replica = rep.index
        for r in reqs:
            r.priority = priority
            rep.scheduler.add(r)
        rep.wake.set()
        return sub

    async def generate(self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None,
                       params: SamplingParams | dict | None = None, rid: str | None = None,
                       priority: int = 0) -> AsyncIterator[GenerateOutput]:
        """Stream outputs of one call (``params.n`` samples, told apart by ``index``);
        leaving the loop early aborts the call."""
        if isinstance(params, dict):
            params = SamplingParams(**params)
        grammar = await self.compile_grammar(params) if params is not None else None
        sub = self.submit(prompt, input_ids=input_ids, params=params, rid=rid, priority=priority, grammar=grammar)
        try:
            async for out in sub:
                yield out
        finally:
            sub.close()

    async def abort(self, rid: str) -> bool:
        """Abort a running call; its KV returns to the pool at the next step boundary."""
        return self._abort(rid)

    def _abort(self, rid: str) -> bool:
        reqs = self.outputs.by_rid.get(rid)
        if not reqs:
            return False
        for r in reqs:
            if r.finish_reason is None:
                r.aborted = True  # Scheduler.abort: it leaves at its replica's next step
        for rep in self.replicas:
            if rep.wake is not None:
                rep.wake.set()
        return True

    def abort_all(self) -> int:
        """Abort every call in flight (drain timeout); returns how many."""
        rids = list(self.outputs.by_rid)
        for rid in rids:
            self._abort(rid)
        return len(rids)

    @property
    def slow_consumer_aborts(self) -> int:
        """Calls aborted because their outputs were not read."""
        return self.outputs.slow_consumer_aborts

    @property
    def num_inflight(self) -> int:
        return len(self.outputs.by_rid)

    @property
    def loop_running(self) -> bool:
        """True while every replica's batching loop is alive (started and not ended)."""
        return self._started and all(rep.task is not None and not rep.task.done() for rep in self.replicas)

    @property
    def loop_stopped(self) -> bool:
        """True if a started batching loop has ended (the engine cannot serve)."""
        return any(rep.task is not None and rep.task.done() for rep in self.replicas)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, over all replicas."""
        return sum(len(rep.scheduler.waiting) for rep in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(len(rep.scheduler.running) for rep in self.replicas)

    def kv_usage(self) -> float:
        """Share of KV slots not free, over all replicas."""
        total = sum(rep.allocator.total for rep in self.replicas)
        return 1.0 - sum(rep.allocator.available for rep in self.replicas) / total

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict:
        """Counters summed over the replicas; with dp_size > 1 also each replica's own
        (``replicas``) and the router's (``routing``)."""
        per = [rep.stats() for rep in self.replicas]
        engine_wide = {"inflight": self.num_inflight, "slow_consumer_aborts": self.slow_consumer_aborts,
                       "gc": gc_control.pauses()}
        if len(per) == 1:
            return {**per[0], **engine_wide, "cache_tiers": self._tier_stats()}
        out = {**engine_wide}
        out |= {key: sum(p[key] for p in per) for key in per[0] if key not in ("kv", "kv_usage", "cache_hit_rate")}
        out["kv"] = {key: sum(p["kv"][key] for p in per) for key in per[0]["kv"]}
        out["kv_usage"] = 1.0 - out["kv"]["free"] / out["kv"]["total"]
        q = out["cache_queried_tokens"]
        out["cache_hit_rate"] = out["cache_hit_tokens"] / q if q else 0.0
        out["replicas"] = per
        out["routing"] = self.router.stats()
        out["cache_tiers"] = self._tier_stats()
        return out

    def _tier_stats(self) -> dict[str, dict]:
        """Per tier: ``TierStats`` plus the mean load time of a page (tiers are shared)."""
        out = {}
        for t in self.cache_tiers:
            s = t.stats.as_dict()
            s["load_seconds_mean"] = s["load_seconds"] / s["hits"] if s["hits"] else 0.0
            out[t.name] = s
        return out

    def step_age(self) -> float:
        """Seconds the longest-running step now running (on any replica) has taken so far;
        0 between steps."""
        now = time.monotonic()
        return max((now - started for rep in self.replicas if (started := rep.step_started) is not None),
                   default=0.0)

    def check_accounting(self) -> None:
        for rep in self.replicas:
            rep.scheduler.check_accounting()

    def flush_cache(self) -> bool:
        """Empty every replica's radix cache (False if one is in use: nothing is flushed
        there, the others are)."""
        flushed = [rep.cache.reset() for rep in self.replicas]
        if self.router is not None and all(flushed):
            self.router.clear()
        return all(flushed)
