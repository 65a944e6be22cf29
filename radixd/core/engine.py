"""``Engine``: the Python API. An asyncio batching loop per replica over its worker thread.

    generate() -> validate + tokenize -> Router.pick (dp_size > 1) -> Scheduler.add ->
    [replica's loop: schedule -> worker.launch (thread) -> Scheduler.process ->
    detokenize/stream -> release_finished] -> outputs

Everything but the forward pass runs on the event loop's thread; worker threads only
compute. Requests are aborted when their consumer stops iterating. With ``dp_size`` > 1
each replica (model copy, KV pool, radix tree, scheduler, worker) runs its own loop task;
the ``n`` samples of one call stay on one replica.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from radixd.core import gc_control
from radixd.core.config import EngineConfig
from radixd.core.detokenizer import IncrementalDetokenizer
from radixd.core.errors import ContextLengthExceeded, EngineStopped, InvalidRequest
from radixd.core.kv_pool import RowAllocator, SlotAllocator, kv_bytes_per_token
from radixd.core.model_loader import read_config, resolve_model
from radixd.core.radix_cache import RadixCache
from radixd.core.request import Group, Request
from radixd.core.router import Router
from radixd.core.sampling_params import SamplingParams
from radixd.core.scheduler import NEED_SYNC, ScheduledStep, Scheduler
from radixd.core.worker import ModelWorker, bind_device, on_device

log = logging.getLogger("radixd.engine")

DEFAULT_KV_BYTES_CPU = 512 * 1024**2


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerateOutput:
    """One streamed update of one of the ``n`` samples of a ``generate`` call."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With ``prompt_logprobs_from``: the prompt tokens' logprobs from that position on (in
    # the sample's first update only).
    prompt_logprobs: list[float] | None = None


class OutputQueue:
    """An unbounded FIFO of one call's outputs: ``asyncio.Queue``'s interface for what the
    engine uses (``put_nowait``, ``get``, ``get_nowait``, ``qsize``, ``empty``) at less cost
    per item, since the loop puts one item per running request per step."""

    __slots__ = ("_items", "_getters")

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._getters: collections.deque[asyncio.Future] = collections.deque()

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self._getters:
            self._wake_next()

    async def get(self):
        items = self._items
        while not items:
            g = asyncio.get_running_loop().create_future()
            self._getters.append(g)
            try:
                await g
            except BaseException:
                g.cancel()  # if not done yet
                with contextlib.suppress(ValueError):
                    self._getters.remove(g)
                if items and not g.cancelled():  # woken, then cancelled: pass the wake-up on
                    self._wake_next()
                raise
        return items.popleft()

    def _wake_next(self) -> None:
        getters = self._getters
        while getters:
            g = getters.popleft()
            if not g.done():
                g.set_result(None)
                return

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


class Submission:
    """The outputs of one ``Engine.submit`` call, as an async iterator.

    ``close()`` (or leaving ``generate``'s loop) aborts whatever has not finished.
    """

    def __init__(self, engine: Engine, rid: str, reqs: list[Request], queue: OutputQueue, n: int, prompt_tokens: int):
        self.engine = engine
        self.rid = rid
        self.reqs = reqs
        self.prompt_tokens = prompt_tokens
        self.n = n
        self._queue = queue
        self._left = n
        self.replica = 0  # which data-parallel replica serves it

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._left == 0:
            self.close()
            raise StopAsyncIteration
        q = self._queue
        item = q.get_nowait() if q.qsize() else await q.get()
        if isinstance(item, BaseException):
            self._left = 0
            self.close()
            raise item
        if item.finished:
            self._left -= 1
        return item

    def close(self) -> None:
        """Abort unfinished samples and forget the call (idempotent)."""
        if self.engine._by_rid.get(self.rid) is self.reqs:
            if self._left:
                self.engine._abort(self.rid)
            del self.engine._by_rid[self.rid]


@dataclass
class _Stream:
    queue: OutputQueue
    detok: IncrementalDetokenizer | None
    prompt_lp_sent: bool = False
    rid: str = ""
    limit: int = 0  # outputs left unread before the call is aborted; 0: unbounded
    held: GenerateOutput | None = None  # tokens not yet sent (stream_interval > 1)

    def flush(self) -> None:
        if self.held is not None:
            self.queue.put_nowait(self.held)
            self.held = None


class Replica:
    """One model copy: its worker (thread), KV slots, radix tree and scheduler, and the
    state of its batching loop."""

    def __init__(self, index: int, worker, config: EngineConfig, policy, *, eos_token_ids, context_len: int,
                 tiers=None, vocab_size: int | None = None):
        self.index = index
        self.worker = worker
        self.allocator = SlotAllocator(worker.pool.num_slots)
        self.rows = RowAllocator(config.max_running_requests)
        self.cache = RadixCache(self.allocator, enabled=config.radix_cache)
        self.policy = policy
        self.tiers = tiers  # KVHierarchy over this replica's pool, or None
        self.scheduler = Scheduler(config, allocator=self.allocator, rows=self.rows, cache=self.cache,
                                   policy=policy, eos_token_ids=eos_token_ids, context_len=context_len,
                                   tiers=tiers, vocab_size=vocab_size,
                                   cascade_members=getattr(worker, "cascade_members", 0))
        device = worker.device
        self.executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"radixd-worker-{device}", initializer=bind_device, initargs=(device,))
        self.inflight = None  # (step, picks on the device, launch time) not yet read back
        # monotonic time the step now running began (None between steps): read by the
        # stall watchdog (another thread) and /health
        self.step_started: float | None = None
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    @property
    def load(self) -> int:
        """Requests waiting or running here (what the router balances)."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)


class Engine:
    """Serve one model: ``async for out in engine.generate("Hi", params=...)``.

    The engine starts its batching loop on first use (or ``await engine.start()``) on the
    running event loop; ``await engine.stop()`` ends it.
    """

    def __init__(self, config: EngineConfig | None = None, *, plugin_manager=None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        self.config = config
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.device)
        self.model_path = resolve_model(config.model, config.cache_dir)
        self.model_cfg = read_config(self.model_path)
        # None: token ids in and out only (tokenizer = "none", for benchmarks)
        self.tokenizer = None if config.tokenizer == "none" else _load_tokenizer(config.tokenizer or self.model_path)
        self.context_len = min(self.model_cfg.context_len, config.max_context_len or 1 << 62)
        self.eos_token_ids = _eos_ids(self.model_cfg, self.tokenizer)

        _check_parallel(config, self.model_cfg, self.device)

        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if plugin_manager is None:
            from radixd.plugins import make_plugin_manager

            plugin_manager = make_plugin_manager(allow=config.plugins_allow, block=config.plugins_block)
        self.plugins = plugin_manager
        self.replicas: list[Replica] = []
        self.cache_tiers = []  # the tier objects, shared by the replicas (content keys name any)
        for d in range(config.dp_size):
            devices = _replica_devices(self.device, d, config.dp_size, config.tp_size)
            worker = self._make_worker(devices, backend)
            self.replicas.append(Replica(d, worker, config, self._make_policy(config.policy),
                                         eos_token_ids=self.eos_token_ids, context_len=self.context_len,
                                         tiers=self._make_hierarchy(worker),
                                         vocab_size=self.model_cfg.vocab_size))
        self.device = self.replicas[0].worker.device
        self.router = None
        if config.dp_size > 1:
            self.router = Router(config.dp_size, policy=config.routing,
                                 balance_threshold=config.routing_balance_threshold,
                                 balance_ratio=config.routing_balance_ratio,
                                 capacity_tokens=self.replicas[0].allocator.total,
                                 loads=lambda: [rep.load for rep in self.replicas])
        self.grammars = self._make_grammar_service()
        # reads a step's picks while the worker thread runs the next one (deferred grammar masks)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixd-reader")
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._streams: dict[Request, _Stream] = {}
        self._by_rid: dict[str, list[Request]] = {}
        self._started = False
        self._stopping = False
        self.step_hook = None  # optional callable(ScheduledStep), for tests and statistics
        self.slow_consumer_aborts = 0  # calls aborted because their outputs were not read

    def _make_worker(self, devices: list[torch.device], backend: str):
        kw = dict(model_path=self.model_path, model_cfg=self.model_cfg, dtype=self.dtype,
                  load_format=self.config.load_format, attention_backend=backend, kv_slots=self._kv_slots,
                  max_rows=self.config.max_running_requests, max_context_len=self.context_len,
                  cuda_graphs=self.config.cuda_graphs, cascade_attention=self.config.cascade_attention)
        if len(devices) > 1:
            from radixd.core.tensor_parallel import TPWorker

            return TPWorker(devices=devices, peer_all_reduce=self.config.peer_all_reduce, **kw)
        with on_device(devices[0]):
            return ModelWorker(device=devices[0], **kw)

    # The first replica's parts (the only ones with dp_size = 1).
    @property
    def worker(self):
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
    def policy(self):
        return self.replicas[0].policy

    @property
    def tiers(self):
        """The first replica's ``KVHierarchy`` (None without ``cache_tiers``)."""
        return self.replicas[0].tiers

    # ------------------------------------------------------------------ set-up

    def _kv_slots(self, free_bytes: int | None) -> int:
        """Pool size in slots; called by the worker once the weights are on the device
        (``free_bytes``: the device's free memory then, None on CPU)."""
        c = self.config
        if c.kv_cache_tokens is not None and c.kv_cache_bytes is None:
            return c.kv_cache_tokens + 1
        # each device of a replica holds its share of the KV heads
        kv_heads = self.model_cfg.num_kv_heads // c.tp_size
        per_token = kv_bytes_per_token(self.model_cfg.num_layers, kv_heads, self.model_cfg.head_dim, self.dtype)
        budget = c.kv_cache_bytes
        if budget is None:
            budget = int(free_bytes * c.mem_fraction) if free_bytes is not None else DEFAULT_KV_BYTES_CPU
        return max(2, budget // per_token + 1)

    def _make_policy(self, name: str):
        table: dict[str, type] = {}
        for provided in self.plugins.hook.radixd_schedule_policies():
            for key, cls in (provided or {}).items():
                if key in table and table[key] is not cls:
                    raise ValueError(f"two plugins provide a scheduling policy named {key!r}")
                table[key] = cls
        if name not in table:
            from radixd.core.errors import ConfigError

            raise ConfigError("policy", name, "one of " + ", ".join(sorted(table)))
        return table[name](self.config)

    def _make_hierarchy(self, worker):
        """A ``KVHierarchy`` over ``worker``'s pool and the tiers named in ``cache_tiers``
        (made on first use, from the ``radixd_cache_tiers`` hook: built-ins and plugins alike)."""
        c = self.config
        if not c.cache_tiers:
            return None
        from radixd.core.tiers.hierarchy import KVHierarchy

        if not self.cache_tiers:
            self.cache_tiers = self._make_tiers()
        return KVHierarchy(self.cache_tiers, pool=worker.pool, page_tokens=c.cache_page_tokens,
                           identity=self.cache_tiers[0].ctx.identity, write_policy=c.cache_write_policy,
                           write_hits=c.cache_write_hits, prefetch=c.cache_prefetch)

    def _make_tiers(self) -> list:
        from radixd.core.errors import ConfigError
        from radixd.core.tiers import TierContext

        c = self.config
        table: dict[str, type] = {}
        for provided in self.plugins.hook.radixd_cache_tiers():
            for key, cls in (provided or {}).items():
                if key in table and table[key] is not cls:
                    raise ValueError(f"two plugins provide a cache tier named {key!r}")
                table[key] = cls
        m = self.model_cfg
        ctx = TierContext(identity=self._kv_identity(),
                          page_shape=(2, m.num_layers, c.cache_page_tokens, m.num_kv_heads, m.head_dim),
                          dtype=self.dtype, device=self.device)
        tiers = []
        try:
            for name in c.cache_tiers:
                if name not in table:
                    raise ConfigError("cache.tiers", name, "tiers provided by loaded plugins: " + ", ".join(sorted(table)))
                tier = table[name](dict(c.cache_tier_options.get(name, {})), ctx)
                tier.name = name
                tiers.append(tier)
        except BaseException:
            for t in tiers:
                t.close()
            raise
        log.info("cache tiers: %s (pages of %d tokens, %d bytes; %s)", ", ".join(c.cache_tiers), c.cache_page_tokens,
                 ctx.page_bytes, c.cache_write_policy)
        return tiers

    def _kv_identity(self) -> str:
        """What makes stored KV valid for this engine: the model's config and weights files,
        dtype, device kind, attention backend and page size (pages of another identity are misses)."""
        h = hashlib.sha256(b"radixd-kv-pages-1")
        path = self.model_path
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            if f.name == "config.json":
                h.update(f.read_bytes())
            elif f.suffix in (".safetensors", ".gguf", ".bin") and self.config.load_format != "dummy":
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        c = self.config
        h.update(f"{c.load_format}|{self.dtype}|{self.device.type}|{c.attention_backend}|{c.cache_page_tokens}".encode())
        return h.hexdigest()

    def _make_grammar_service(self):
        """The configured grammar backend (from the ``radixd_grammar_backends`` hook) behind a
        compile service; None without a tokenizer (constrained requests are then refused)."""
        from radixd.core.errors import ConfigError
        from radixd.grammars.service import GrammarService

        table: dict[str, type] = {}
        for provided in self.plugins.hook.radixd_grammar_backends():
            for key, cls in (provided or {}).items():
                if key in table and table[key] is not cls:
                    raise ValueError(f"two plugins provide a grammar backend named {key!r}")
                table[key] = cls
        name = self.config.grammar_backend
        if name not in table:
            raise ConfigError("grammar_backend", name, "one of " + ", ".join(sorted(table)))
        if self.tokenizer is None:
            return None
        backend = table[name](self.config, tokenizer=self.tokenizer, vocab_size=self.model_cfg.vocab_size,
                              eos_ids=self.eos_token_ids)
        c = self.config
        limits = None
        if c.grammar_compile_memory_mb:
            from radixd.core.sandbox import LimitedPool
            from radixd.grammars.service import backend_in_worker

            limits = LimitedPool(c.grammar_compile_workers, timeout_s=c.grammar_compile_timeout,
                                 memory_bytes=c.grammar_compile_memory_mb * 2**20, initializer=backend_in_worker,
                                 initargs=(table[name], c, self.tokenizer, self.model_cfg.vocab_size,
                                           self.eos_token_ids))
        return GrammarService(backend, workers=c.grammar_compile_workers, timeout_s=c.grammar_compile_timeout,
                              cache_size=c.grammar_cache_size, limits=limits)

    async def compile_grammar(self, params: SamplingParams):
        """Compile (or fetch from the cache) the request's constraint off the event loop;
        None if it has none. Raises ``InvalidRequest`` naming the field (HTTP 400)."""
        from radixd.grammars import GrammarError

        c = params.constraint
        if c is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(c[0], "grammar constraints need a tokenizer; this engine runs without one")
        try:
            return await self.grammars.get(*c)
        except GrammarError as exc:
            raise InvalidRequest(exc.field, exc.message) from None

    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if not self._started:
            self._started = True
            self._stopping = False
            gc_control.acquire(freeze=self.config.gc_freeze, threshold=self.config.gc_threshold)
            loop = asyncio.get_running_loop()
            for rep in self.replicas:
                rep.wake = asyncio.Event()
                name = "radixd-batching-loop" + (f"-{rep.index}" if len(self.replicas) > 1 else "")
                rep.task = loop.create_task(self._loop(rep), name=name)

    async def stop(self) -> None:
        """Abort everything in flight and end the batching loops."""
        self._stopping = True
        for reqs in list(self._by_rid.values()):
            for r in reqs:
                r.aborted = True
        for rep in self.replicas:
            if rep.task is not None:
                rep.wake.set()
                await rep.task
                rep.task = None
        if self._started:
            gc_control.release()
        self._started = False
        for rep in self.replicas:
            rep.executor.shutdown(wait=True)
            close = getattr(rep.worker, "close", None)
            if close is not None:
                close()
        for rep in self.replicas:  # queued writes reach the tiers, then the tiers close
            if rep.tiers is not None:
                rep.tiers.close(close_tiers=False)
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

    # ------------------------------------------------------------------ requests

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def apply_chat_template(self, messages: list[dict], **kw) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def validate(self, prompt: str | None, input_ids: Sequence[int] | None, params: SamplingParams) -> list[int]:
        """Check a request; return its prompt token ids. Raises ``InvalidRequest``."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("prompt", "give exactly one of prompt (text) or input_ids")
        if input_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequest("prompt", "must be a string")
            if self.tokenizer is None:
                raise InvalidRequest("prompt", "this engine runs without a tokenizer: send input_ids")
            ids = self.tokenize(prompt)
            if ids and max(ids) >= self.model_cfg.vocab_size:  # a tokenizer larger than the embedding
                raise InvalidRequest("prompt", f"the text tokenizes to token id {max(ids)}, outside the "
                                               f"model's vocabulary of {self.model_cfg.vocab_size}")
        else:
            ids = list(input_ids)
            vocab = self.model_cfg.vocab_size
            # plain ints (what JSON gives) checked at C speed: a long prompt's per-token Python
            # check cost as much as the rest of its admission
            if set(map(type, ids)) <= {int}:
                ok = not ids or (min(ids) >= 0 and max(ids) < vocab)
            else:
                ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
            if not ok:
                raise InvalidRequest("input_ids", f"token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidRequest("prompt", "the prompt is empty")
        if self.tokenizer is None and params.stop:
            raise InvalidRequest("stop", "stop strings need a tokenizer; this engine runs without one")
        if params.n > self.config.max_n:
            raise InvalidRequest("n", f"must be <= {self.config.max_n}, got {params.n}")
        if params.top_logprobs > self.config.max_top_logprobs:
            raise InvalidRequest("top_logprobs", f"must be <= {self.config.max_top_logprobs}, got {params.top_logprobs}")
        if len(ids) >= self.context_len:
            raise ContextLengthExceeded(
                "prompt", len(ids), self.context_len,
                f"the prompt has {len(ids)} tokens; the model's context is {self.context_len} tokens",
            )
        if len(ids) + params.max_new_tokens > self.context_len:
            raise ContextLengthExceeded(
                "max_new_tokens", len(ids), self.context_len,
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's context of {self.context_len} tokens",
            )
        need = len(ids) + params.n * params.max_new_tokens
        if need > self.allocator.total:  # every replica's pool has this size
            field_name = "n" if params.n > 1 else "max_new_tokens"
            raise InvalidRequest(
                field_name,
                f"the request needs up to {need} KV slots (prompt {len(ids)} + n {params.n} x "
                f"max_new_tokens {params.max_new_tokens}); the KV pool holds {self.allocator.total}",
            )
        return ids

    def submit(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        priority: int = 0,
        max_unread: int = 0,
        grammar=None,
    ) -> Submission:
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
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        ids = self.validate(prompt, input_ids, params)
        rid = rid or uuid.uuid4().hex
        if rid in self._by_rid:
            raise InvalidRequest("rid", f"a request with id {rid!r} is already running")
        self._ensure_started()
        queue = OutputQueue()
        if params.max_new_tokens == 0:
            for i in range(params.n):
                queue.put_nowait(GenerateOutput(i, [], "", True, "length", prompt_tokens=len(ids)))
            return Submission(self, rid, [], queue, params.n, len(ids))
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
        reqs = self._make_requests(rep, rid, ids, params)
        if grammar is not None:
            for r in reqs:
                r.matcher = grammar.matcher()  # one per sample
        for r in reqs:
            r.priority = priority
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                               stop=params.stop)
            self._streams[r] = _Stream(queue, detok, rid=rid, limit=max_unread * len(reqs))
            rep.scheduler.add(r)
        self._by_rid[rid] = reqs
        rep.wake.set()
        sub = Submission(self, rid, reqs, queue, len(reqs), len(ids))
        sub.replica = rep.index
        return sub

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[GenerateOutput]:
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

    def _make_requests(self, rep: Replica, rid: str, ids: list[int], params: SamplingParams) -> list[Request]:
        ns = rep.cache.default_namespace()
        group = Group(size=params.n, namespace=ns, followers_waiting=params.n - 1) if params.n > 1 else None
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        reqs = []
        for i in range(params.n):
            seed = base_seed if i == 0 else (base_seed * 1_000_003 + i) % (1 << 62)
            reqs.append(
                Request(
                    rid=rid if params.n == 1 else f"{rid}-{i}",
                    prompt_ids=ids,
                    params=params,
                    seed=seed,
                    arrival=rep.scheduler.next_arrival(),
                    namespace=ns,
                    index=i,
                    group=group,
                )
            )
        return reqs

    async def abort(self, rid: str) -> bool:
        """Abort a running call; its KV returns to the pool at the next step boundary."""
        return self._abort(rid)

    def _abort(self, rid: str) -> bool:
        reqs = self._by_rid.get(rid)
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
        rids = list(self._by_rid)
        for rid in rids:
            self._abort(rid)
        return len(rids)

    @property
    def num_inflight(self) -> int:
        return len(self._by_rid)

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

    # ------------------------------------------------------------------ the loop

    async def _loop(self, rep: Replica) -> None:
        """A replica's batching loop. A failure of one step fails the requests in flight,
        never the loop itself (a dead loop would leave every caller waiting forever)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not await self._step(loop, rep):
                    return
            except Exception as exc:
                log.exception("batching step failed; failing the requests in flight")
                self._fail_all(rep, exc)

    async def _step(self, loop: asyncio.AbstractEventLoop, rep: Replica) -> bool:
        """Schedule and launch one batch, then finish the one launched before it (overlap:
        the device runs step N+1 while the loop reads step N's picks and streams them).
        False when the engine has stopped."""
        prev = rep.inflight
        step = rep.scheduler.schedule(prev[0] if prev else None)
        self._report_dropped(rep)
        if step is NEED_SYNC or (step is None and prev is not None):
            rep.inflight = None
            rep.step_started = time.monotonic()
            try:
                await self._finish(loop, rep, prev, frozenset())
            finally:
                rep.step_started = None
            return True
        if step is None:
            if self._stopping:
                return False
            rep.wake.clear()
            await rep.wake.wait()
            return True
        t0 = time.perf_counter()
        rep.step_started = time.monotonic()
        try:
            return await self._run(loop, rep, step, prev, t0)
        finally:
            rep.step_started = None

    async def _run(self, loop: asyncio.AbstractEventLoop, rep: Replica, step: ScheduledStep, prev,
                   t0: float) -> bool:
        sb = step.batch.sampling
        if sb is not None and sb.allowed_future is not None:
            return await self._run_deferred(loop, rep, step, prev, t0)
        try:
            picks = await loop.run_in_executor(rep.executor, rep.worker.launch, step.batch,
                                               prev[1] if prev else None)
        except Exception as exc:  # a failed forward fails its requests, not the engine
            log.exception("forward pass failed; failing %d requests", len(step.reqs))
            rep.scheduler.rollback(step)
            self._fail(rep, step, exc)
            return True
        rep.inflight = (step, picks, t0)
        if prev is not None:
            await self._finish(loop, rep, prev, frozenset(step.reqs))
        if not self.config.overlap_schedule:
            rep.inflight = None
            await self._finish(loop, rep, (step, picks, t0), frozenset())
        return True

    async def _run_deferred(self, loop: asyncio.AbstractEventLoop, rep: Replica, step: ScheduledStep, prev,
                            t0: float) -> bool:
        """Overlap with grammar masks: launch step N+1, read step N (its tokens reach the
        matchers), fill N+1's masks while its forward runs, then let it sample."""
        sb = step.batch.sampling
        launched = loop.run_in_executor(rep.executor, rep.worker.launch, step.batch, prev[1])
        try:
            await self._finish(loop, rep, prev, frozenset(step.reqs), reader=self._reader)
            sb.allowed_future.set_result(torch.from_numpy(
                rep.scheduler.fill_masks(len(step.sampled), sb.deferred_masks)))
        finally:
            if not sb.allowed_future.done():  # never leave the worker waiting
                sb.allowed_future.set_exception(RuntimeError("grammar masks were not computed"))
        try:
            picks = await launched
        except Exception as exc:
            log.exception("forward pass failed; failing %d requests", len(step.reqs))
            rep.scheduler.rollback(step)
            self._fail(rep, step, exc)
            return True
        rep.inflight = (step, picks, t0)
        return True

    async def _finish(self, loop, rep: Replica, launched, inflight: frozenset, reader=None) -> None:
        """Read a launched step's picks, stream them, release what finished."""
        step, picks, t0 = launched
        try:
            out = await loop.run_in_executor(reader or rep.executor, rep.worker.resolve, picks)
        except Exception as exc:
            log.exception("forward pass failed; failing %d requests", len(step.reqs))
            rep.scheduler.rollback(step)
            self._fail(rep, step, exc)
            return
        accepted = rep.scheduler.process(step, out)
        self._emit(step, out, accepted)
        for r in rep.scheduler.release_finished(inflight):
            self._streams.pop(r, None)
        step.step_ms = (time.perf_counter() - t0) * 1000
        if self.step_hook is not None:
            try:
                self.step_hook(step)
            except Exception:
                log.exception("step hook failed")

    def _emit(self, step: ScheduledStep, out, accepted: list[int]) -> None:
        streams = self._streams
        interval = self.config.stream_interval
        eos = self.eos_token_ids
        sampled = step.sampled
        next_tokens = out.next_tokens
        out_logprobs = out.logprobs
        for i in accepted:
            r = sampled[i]
            stream = streams.get(r)
            if stream is None:
                continue
            tok = next_tokens[i]
            detok = stream.detok
            p = r.params
            reason = r.finish_reason
            if detok is None:
                text = ""
            elif reason == "stop" and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
                text = ""  # a stop token id or EOS: no text
            else:
                text = detok.add(tok)
                if detok.stopped:  # a stop string, even on the last allowed token
                    r.finish("stop")
                    reason = r.finish_reason
            finished = reason is not None
            if finished and detok is not None and not detok.stopped:
                text += detok.finish()
            lp = None
            if p.logprobs and out_logprobs is not None:
                top = out.top_logprobs[i][: p.top_logprobs] if out.top_logprobs else []
                lp = [TokenLogprob(tok, out_logprobs[i], top)]
            plp = None
            if p.prompt_logprobs_from is not None and not stream.prompt_lp_sent:
                plp = list(r.prompt_logprobs)
                stream.prompt_lp_sent = True
            queue = stream.queue
            update = GenerateOutput(r.index, [tok], text, finished, reason, lp, len(r.prompt_ids),
                                    r.num_output, r.cached_tokens or 0, plp)
            if interval > 1:  # coalesce: send every ``interval`` tokens, and at the end
                held = stream.held
                if held is not None:
                    held.token_ids.append(tok)
                    held.text += text
                    held.finished, held.finish_reason = finished, reason
                    held.completion_tokens = update.completion_tokens
                    if lp is not None:
                        held.logprobs = (held.logprobs or []) + lp
                    update = held
                    stream.held = None
                if not finished and len(update.token_ids) < interval:
                    stream.held = update
                    continue
            queue.put_nowait(update)
            if stream.limit and queue.qsize() > stream.limit and not finished and not r.aborted:
                log.warning("outputs of %s are not being read (%d waiting): aborting it", stream.rid,
                            queue.qsize())
                self.slow_consumer_aborts += 1
                self._abort(stream.rid)

    def _report_dropped(self, rep: Replica) -> None:
        """Tell consumers of requests the scheduler dropped (aborts) that they ended."""
        for r in rep.scheduler.take_dropped():
            stream = self._streams.pop(r, None)
            if stream is not None:
                stream.flush()
                stream.queue.put_nowait(
                    GenerateOutput(r.index, [], "", True, r.finish_reason, prompt_tokens=len(r.prompt_ids),
                                   completion_tokens=r.num_output, cached_tokens=r.cached_tokens or 0)
                )

    def _fail_all(self, rep: Replica, exc: Exception) -> None:
        """A replica's step failed outside the forward pass: fail what that replica holds."""
        if rep.inflight is not None:
            rep.scheduler.rollback(rep.inflight[0])
            rep.inflight = None
        mine = set(rep.scheduler.waiting) | set(rep.scheduler.running)
        for r, stream in list(self._streams.items()):
            if r in mine:
                rep.scheduler.abort(r)
                stream.queue.put_nowait(RuntimeError(f"engine step failed: {exc!r}"))
                del self._streams[r]

    def _fail(self, rep: Replica, step: ScheduledStep, exc: Exception) -> None:
        for r in step.reqs:
            rep.scheduler.abort(r)
            stream = self._streams.pop(r, None)
            if stream is not None:
                stream.queue.put_nowait(RuntimeError(f"forward pass failed: {exc}"))

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict:
        """Counters summed over the replicas; with dp_size > 1 also each replica's own
        (``replicas``) and the router's (``routing``)."""
        per = [_replica_stats(rep) for rep in self.replicas]
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


def _replica_stats(rep: Replica) -> dict:
    acc = rep.scheduler.accounting()
    cache, st = rep.cache, rep.scheduler.stats
    return {
        "running": len(rep.scheduler.running),
        "waiting": len(rep.scheduler.waiting),
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
    }


def _check_parallel(config: EngineConfig, cfg, device: torch.device) -> None:
    """dp_size/tp_size against the model's shape and the visible devices."""
    from radixd.core.errors import ConfigError

    tp = config.tp_size
    for what, n in (("KV heads", cfg.num_kv_heads), ("attention heads", cfg.num_heads),
                    ("MLP width", cfg.intermediate_size)):
        if n % tp:
            raise ConfigError("tp_size", tp, f"a divisor of the model's {what} ({n}); the model has "
                              f"{cfg.num_heads} heads, {cfg.num_kv_heads} KV heads")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if config.dp_size * tp > visible:
            raise ConfigError("dp_size", config.dp_size,
                              f"dp_size * tp_size <= {visible} (the visible CUDA devices); tp_size is {tp}")


def _replica_devices(device: torch.device, d: int, dp: int, tp: int) -> list[torch.device]:
    """Devices of replica ``d``: cuda:d*tp .. cuda:d*tp+tp-1 (the default device when one
    replica uses one GPU); on CPU, tp CPU workers."""
    if device.type != "cuda":
        return [device] * tp
    if dp * tp == 1:
        return [device]
    return [torch.device("cuda", d * tp + t) for t in range(tp)]


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from radixd.core.errors import ConfigError

        raise ConfigError("device", name, "'cpu' (no CUDA device is visible) or 'auto'")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _eos_ids(cfg, tokenizer) -> tuple[int, ...]:
    """EOS ids from the model's config plus the tokenizer's (if there is one)."""
    ids = list(cfg.eos_token_ids)
    tid = getattr(tokenizer, "eos_token_id", None)
    if tid is not None and tid not in ids:
        ids.append(tid)
    return tuple(ids)
