"""Compiling grammars for the engine: a worker pool, a time limit and an LRU cache."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable

from radixd.grammars import GrammarError
from radixd.grammars.caches import lru_get, lru_put
from radixd.grammars.triggers import AfterText
from radixd.grammars.vocab import TokenizerInfo

Key = tuple[str, str, str | None]  # (kind, spec, grammar_after)


class GrammarService:
    """Compiles (kind, spec) with one backend for one tokenizer; with ``after`` (a request's
    ``grammar_after``) the grammar applies from that text in the output on
    (``triggers.AfterText``, over the backend's grammar for (kind, spec), itself cached).

    Compilation runs in ``workers`` threads so the event loop keeps serving; a compile that
    takes longer than ``timeout_s`` fails its request with ``GrammarError`` (its thread
    finishes in the background and its result is still cached). Compiled grammars are kept
    in an LRU of ``cache_size`` entries; concurrent requests for one grammar share a compile.
    ``vocab`` gives the tokenizer's ``TokenizerInfo`` (called in a compile thread, when an
    ``after`` first needs it; without it ``after`` is refused).
    """

    def __init__(self, backend, *, workers: int, timeout_s: float, cache_size: int, limits=None,
                 vocab: Callable[[], TokenizerInfo] | None = None):
        self.backend = backend
        self.limits = limits  # a radixd.core.sandbox.LimitedPool for trial compiles, or None
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[Key, object] = OrderedDict()
        self._pending: dict[Key, asyncio.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="radixd-grammar")
        self.compiles = 0
        self.hits = 0
        self.trials_killed = 0

    def stats(self) -> dict[str, int]:
        """The compile cache's counters (compiles started, hits, grammars kept, trials killed)."""
        return {"compiles": self.compiles, "hits": self.hits, "cached": len(self._cache),
                "trials_killed": self.trials_killed}

    def cached(self, kind: str, spec: str, after: str | None = None):
        return lru_get(self._cache, (kind, spec, after))

    def _store(self, key: Key, compiled) -> None:
        lru_put(self._cache, key, compiled, self.cache_size)

    async def get(self, kind: str, spec: str, after: str | None = None):
        key = (kind, spec, after)
        got = self.cached(*key)
        if got is not None:
            self.hits += 1
            return got
        fut = self._pending.get(key)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = asyncio.ensure_future(self._make(key, loop))
            self._pending[key] = fut
            self.compiles += 1

            def done(f: asyncio.Future) -> None:
                self._pending.pop(key, None)
                if not f.cancelled() and f.exception() is None:
                    self._store(key, f.result())

            fut.add_done_callback(done)
        try:
            if self.limits is None:
                return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            return await asyncio.shield(fut)  # each stage of _compile has its own time limit
        except TimeoutError:
            raise GrammarError(kind, f"compiling the {kind} constraint took longer than {self.timeout_s:g} s "
                                     "(grammar.compile_timeout)") from None

    async def _make(self, key: Key, loop):
        kind, spec, after = key
        if after is None:
            return await self._compile(kind, spec, loop)
        inner = await self.get(kind, spec)
        return await asyncio.wrap_future(self._pool.submit(self._after, inner, after), loop=loop)

    def _after(self, inner, after: str) -> AfterText:
        if self.vocab is None:
            raise GrammarError("grammar_after", "this grammar service was made without the tokenizer's vocabulary")
        return AfterText(inner, after, self.vocab())

    async def _compile(self, kind: str, spec: str, loop):
        if self.limits is None:
            return await asyncio.wrap_future(self._pool.submit(self.backend.compile, kind, spec), loop=loop)
        await self._trial(kind, spec)
        return await asyncio.wait_for(asyncio.wrap_future(self._pool.submit(self.backend.compile, kind, spec),
                                                          loop=loop), self.timeout_s)

    async def _trial(self, kind: str, spec: str) -> None:
        """Compile once in a worker process under the time and memory limits: a grammar that
        explodes is killed there, never in the daemon (whose compile threads cannot be stopped)."""
        from radixd.core.sandbox import LimitExceeded

        try:
            failed = await self.limits.run(trial_compile, kind, spec)
        except LimitExceeded as exc:
            self.trials_killed += 1
            if exc.kind == "memory":
                raise GrammarError(kind, f"compiling the {kind} constraint needed more than "
                                         f"{self.limits.memory_bytes // 2**20} MiB (grammar.compile_memory_mb)") from None
            if exc.kind == "time":
                raise GrammarError(kind, f"compiling the {kind} constraint took longer than {self.timeout_s:g} s "
                                         "(grammar.compile_timeout)") from None
            raise GrammarError(kind, f"compiling the {kind} constraint crashed its worker process ({exc})") from None
        if failed is not None:
            raise GrammarError(*failed)

    def compile_now(self, kind: str, spec: str, after: str | None = None):
        """Synchronous compile + cache (for tools and tests off the event loop)."""
        got = self.cached(kind, spec, after)
        if got is None:
            if after is None:
                got = self.backend.compile(kind, spec)
            else:
                got = self._after(self.compile_now(kind, spec), after)
            self._store((kind, spec, after), got)
        return got

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.limits is not None:
            self.limits.close()


def backend_in_worker(cls, config, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """The backend, built once in each trial worker process."""
    return cls(config, tokenizer=tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)


def trial_compile(backend, kind: str, spec: str) -> tuple[str, str] | None:
    """Compile and drop the result: None if it compiles, else the ``GrammarError`` (field,
    message) to raise in the daemon."""
    try:
        backend.compile(kind, spec)
    except GrammarError as exc:
        return exc.field, exc.message
    return None
