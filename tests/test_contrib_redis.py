"""The contrib tier ``plugins-contrib/radixd-redis``, installed for real with pip and run
against a real ``redis-server`` on a free loopback port: found through the ``radixd``
entry-point group, serving evicted prefixes with greedy outputs unchanged, shared with a
new engine, and a server killed mid-run costs misses (logged, counted), never a request."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
from test_kv_tiers import conversations, make_engine, reference, run_chats

from radixd.core.errors import ConfigError
from radixd.plugins import make_plugin_manager

REDIS_SERVER = shutil.which("redis-server")

pytestmark = pytest.mark.skipif(REDIS_SERVER is None,
                                reason="redis-server is not installed (apt-get install redis-server; .ci/run does)")


# redis_plugin and redis_server: conftest.py (test_fp8_kv.py uses them too)


def test_discovered_and_listed(redis_plugin):
    pm = make_plugin_manager()
    names = {}
    for provided in pm.hook.radixd_cache_tiers():
        names.update(provided)
    assert names["redis"] is redis_plugin.RedisTier and {"host", "disk"} <= set(names)
    out = subprocess.run([sys.executable, "-m", "radixd", "plugins"], capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("redis\t") for line in out.splitlines()), out


def test_options_are_checked(redis_plugin, tiny_models):
    path = str(tiny_models["llama"])
    with pytest.raises(ConfigError, match="cache.redis.host"):
        make_engine(path, cache_tiers=("redis",), cache_tier_options={"redis": {"host": "x"}})
    with pytest.raises(ConfigError, match="cache.redis.timeout_s"):
        make_engine(path, cache_tiers=("redis",), cache_tier_options={"redis": {"timeout_s": "1"}})


async def test_greedy_identical_and_shared_with_a_new_engine(redis_plugin, redis_server, tiny_models):
    path = tiny_models["llama"]
    chats = conversations(seed=21)
    want = await reference(path, chats)
    kw = dict(cache_tiers=("redis",), cache_page_tokens=4, cache_tier_options={"redis": {"url": redis_server.url}})
    eng = make_engine(path, **kw)
    try:
        got = await run_chats(eng, chats)
        eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["redis"]
    finally:
        await eng.stop()
    assert got == want
    assert st["stores"] > 0 and st["hits"] > 0 and st["tokens_loaded"] > 0 and st["errors"] == 0

    fresh = make_engine(path, **kw)  # nothing in its pool: every prefix comes from Redis
    try:
        again = await run_chats(fresh, chats)
        st2 = fresh.stats()
    finally:
        await fresh.stop()
    assert again == want
    assert st2["cache_tiers"]["redis"]["tokens_loaded"] > st["tokens_loaded"]


async def test_redis_killed_mid_run(redis_plugin, redis_server, tiny_models, caplog):
    """The server dies while conversations are being served (right after the first page came
    back from it): every request still completes with the no-cache tokens."""
    path = tiny_models["llama"]
    chats = conversations(n=4, turns=3, seed=23)
    want = await reference(path, chats)
    eng = make_engine(path, cache_tiers=("redis",), cache_page_tokens=4, cache_write_policy="write_through",
                      cache_tier_options={"redis": {"url": redis_server.url, "timeout_s": 0.2, "retry_s": 0.05}})
    tier = eng.tiers.tiers[0]
    at_kill = {}

    def hook(step):
        eng.check_accounting()
        if not at_kill and tier.stats.hits > 0:
            at_kill.update(tier.stats.as_dict())
            redis_server.kill()

    eng.step_hook = hook
    try:
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.redis"):
            got = await run_chats(eng, chats)
            eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["redis"]
    finally:
        await eng.stop()
    assert got == want
    assert at_kill and at_kill["errors"] == 0 and at_kill["stores"] > 0
    assert st["errors"] > 0 and st["hits"] == at_kill["hits"]
    assert any("failed" in r.getMessage() and "redis" in r.getMessage() for r in caplog.records)
