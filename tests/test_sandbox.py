"""``LimitedPool``: work that explodes is stopped by its time and memory limits, in a worker
process that is then replaced; the daemon's own memory never sees it."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from radixd.core.sandbox import LimitedPool, LimitExceeded


def square(x):
    return x * x


def forever():
    while True:
        pass


def hog(mib):
    chunks = []
    for _ in range(mib):
        chunks.append(bytearray(2**20))
    return len(chunks)


def fail():
    raise ValueError("bad spec")


def pid():
    return os.getpid()


@pytest.fixture
def pool():
    p = LimitedPool(1, timeout_s=2.0, memory_bytes=256 * 2**20)
    yield p
    p.close()


def test_result_and_exception(pool):
    assert pool.call(square, 7) == 49
    assert pool.call(pid) != os.getpid()  # another process
    with pytest.raises(ValueError, match="bad spec"):
        pool.call(fail)
    assert pool.call(square, 3) == 9


def test_time_limit_kills_and_replaces(pool):
    first = pool.call(pid)
    t0 = time.monotonic()
    with pytest.raises(LimitExceeded) as err:
        pool.call(forever)
    assert err.value.kind == "time" and time.monotonic() - t0 < 6.0
    assert pool.killed["time"] == 1
    assert pool.call(pid) != first  # a fresh worker
    assert pool.call(square, 5) == 25


def test_memory_limit(pool):
    assert pool.call(hog, 64) == 64  # within the limit
    with pytest.raises(LimitExceeded) as err:
        pool.call(hog, 2048)  # 2 GiB against a 256 MiB limit
    assert err.value.kind == "memory" and "256 MiB" in str(err.value)
    assert pool.killed["memory"] == 1
    assert pool.call(square, 2) == 4


def test_async_and_concurrent():
    pool = LimitedPool(2, timeout_s=1.0)
    try:
        async def both():
            return await asyncio.gather(pool.run(square, 2), pool.run(forever), return_exceptions=True)

        ok, late = asyncio.run(both())
        assert ok == 4 and isinstance(late, LimitExceeded) and late.kind == "time"
    finally:
        pool.close()


# ------------------------------------------------------------------------ grammars


def _service(memory_mb: int, timeout_s: float):
    from conftest import _tokenizer

    from radixd.core.config import EngineConfig
    from radixd.grammars.backend import RadixdBackend
    from radixd.grammars.service import GrammarService, backend_in_worker

    tok = _tokenizer()
    args = (EngineConfig(model="unused"), tok, 256, (0,))
    limits = LimitedPool(1, timeout_s=timeout_s, memory_bytes=memory_mb * 2**20, initializer=backend_in_worker,
                         initargs=(RadixdBackend, *args))
    backend = RadixdBackend(args[0], tokenizer=tok, vocab_size=256, eos_ids=(0,))
    return GrammarService(backend, workers=1, timeout_s=timeout_s, cache_size=8, limits=limits)


# an automaton with ~2^13 states: compiling it takes seconds and tens of MiB
EXPLODING = "(a|b)*a(a|b){13}"


def test_grammar_compile_stopped_by_time_limit():
    from radixd.grammars import GrammarError

    svc = _service(memory_mb=1024, timeout_s=0.3)
    try:
        async def go():
            ok = await svc.get("regex", "[0-9]+")  # small grammars still compile (and are cached)
            with pytest.raises(GrammarError, match="grammar.compile_timeout") as err:
                await svc.get("regex", EXPLODING)
            return ok, err.value
        ok, err = asyncio.run(go())
        assert ok is not None and err.field == "regex"
        assert svc.limits.killed["time"] == 1 and svc.trials_killed == 1
        assert svc.cached("regex", EXPLODING) is None  # never compiled in this process
        with pytest.raises(GrammarError, match="not a valid|unbalanced|regex|parenthes"):
            asyncio.run(svc.get("regex", "(a"))  # an ordinary error comes back as itself
    finally:
        svc.shutdown()


def test_grammar_compile_stopped_by_memory_limit():
    from radixd.grammars import GrammarError

    svc = _service(memory_mb=24, timeout_s=60)
    try:
        with pytest.raises(GrammarError, match="grammar.compile_memory_mb"):
            asyncio.run(svc.get("regex", EXPLODING))
        assert svc.limits.killed["memory"] == 1
        assert svc.cached("regex", EXPLODING) is None
    finally:
        svc.shutdown()
