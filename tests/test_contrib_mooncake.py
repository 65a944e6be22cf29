"""The contrib tier ``plugins-contrib/radixd-mooncake``, installed for real with pip and run
against a real Mooncake Store (the wheel's ``mooncake_master`` and a ``mooncake_client``
store service holding the memory, on free loopback ports): found through the ``radixd``
entry-point group, options refused by name, greedy outputs unchanged with pages shared with
a new engine, and the Redis tier's faults: the store killed mid-run, corrupt pages and a full
store cost misses (logged, counted), never a request or KV; a restarted daemon serves old
prefixes from the store."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import Daemon, pip_install_contrib
from test_kv_tiers import conversations, make_engine, reference, run_chats

from radixd.core.errors import ConfigError
from radixd.core.tiers import TierContext
from radixd.plugins import make_plugin_manager

DIST = "radixd-mooncake"
MASTER = shutil.which("mooncake_master")
STORE_SERVICE = shutil.which("mooncake_client")

pytestmark = pytest.mark.skipif(MASTER is None or STORE_SERVICE is None,
                                reason="Mooncake's mooncake_master/mooncake_client are not installed "
                                       "(pip install mooncake-transfer-engine-non-cuda; the test extra does)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeStore:
    """A throwaway Mooncake Store: ``mooncake_master`` and one ``mooncake_client`` store
    service mounting ``segment`` of memory, peers found by P2P handshake. ``kill()`` ends
    both (idempotent)."""

    def __init__(self, workdir: Path, segment: str = "16MB"):
        rpc, svc = _free_port(), _free_port()
        self.address = f"127.0.0.1:{rpc}"
        self.procs: list[subprocess.Popen] = []
        self._start([MASTER, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
                     "--metrics_host=127.0.0.1"], rpc, workdir / "master.log")
        self._start([STORE_SERVICE, "--host=127.0.0.1", f"--port={svc}", f"--master_server_address={self.address}",
                     "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={segment}", "--protocol=tcp"],
                    svc, workdir / "store.log")

    def _start(self, argv: list[str], port: int, log: Path) -> None:
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{Path(argv[0]).name} did not start:\n{log.read_text()[-2000:]}")

    def options(self, **more) -> dict:
        return {"mooncake": {"master_server_address": self.address, **more}}

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def mooncake_plugin(tmp_path_factory):
    yield from pip_install_contrib(DIST, "mooncake", tmp_path_factory.mktemp("contrib"))


@pytest.fixture
def store(tmp_path):
    s = MooncakeStore(tmp_path)
    yield s
    s.kill()


def test_discovered_and_listed(mooncake_plugin):
    pm = make_plugin_manager()
    names = {}
    for provided in pm.hook.radixd_cache_tiers():
        names.update(provided)
    assert names["mooncake"] is mooncake_plugin.MooncakeTier and {"host", "disk"} <= set(names)
    out = subprocess.run([sys.executable, "-m", "radixd", "plugins"], capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("mooncake\t") for line in out.splitlines()), out


CTX = TierContext(identity="model-a", page_shape=(2, 2, 4, 2, 8), dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"master": "x"}, "cache.mooncake.master", "keys master_server_address"),
    ({"timeout_s": "1"}, "cache.mooncake.timeout_s", "a number"),
    ({"protocol": "udp"}, "cache.mooncake.protocol", "one of 'tcp', 'rdma'"),
    ({"master_server_address": "localhost"}, "cache.mooncake.master_server_address", "HOST:PORT"),
    ({"master_server_address": "h:99999"}, "cache.mooncake.master_server_address", "HOST:PORT"),
    ({"global_segment_size": 1 << 20}, "cache.mooncake.global_segment_size", "0 (store in"),
    ({"local_buffer_size": 0}, "cache.mooncake.local_buffer_size", "an integer >= 16777216"),
    ({"metadata_server": ""}, "cache.mooncake.metadata_server", "P2PHANDSHAKE"),
    ({"retry_s": -1}, "cache.mooncake.retry_s", "a number >= 0"),
])
def test_options_are_checked(mooncake_plugin, options, key, allowed):
    with pytest.raises(ConfigError, match=key) as err:
        mooncake_plugin.MooncakeTier(options, CTX)
    assert allowed in err.value.allowed and err.value.value == next(iter(options.values()))


def test_options_are_checked_by_the_engine(mooncake_plugin, tiny_models):
    with pytest.raises(ConfigError, match="cache.mooncake.protocol"):
        make_engine(tiny_models["llama"], cache_tiers=("mooncake",), cache_tier_options={"mooncake": {"protocol": "x"}})


def test_master_down_at_start_is_misses(mooncake_plugin, caplog):
    """No master: the tier is made at once (its port is probed, not Mooncake's seconds-long
    retries), everything is a miss, and it connects later in the background."""
    port = _free_port()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="radixd.tiers.mooncake"):
        tier = mooncake_plugin.MooncakeTier({"master_server_address": f"127.0.0.1:{port}", "retry_s": 60.0}, CTX)
    try:
        assert time.monotonic() - t0 < 10  # Mooncake's own setup retries for ~90 s without a master
        assert tier.client is None and not tier.contains(b"k" * 16) and tier.load(b"k" * 16) is None
        assert tier.stats.errors == 1
        assert any("does not answer" in r.getMessage() for r in caplog.records)
    finally:
        tier.close()


def test_absent_page_is_a_miss_unreadable_page_an_error(mooncake_plugin, store):
    """An absent page is a miss; a page the master lists but whose store service died is an
    error, after which the store is left alone for retry_s."""
    from radixd.core.tiers import Page

    tier = mooncake_plugin.MooncakeTier(store.options(retry_s=60.0)["mooncake"], CTX)
    try:
        page = Page(torch.randn(CTX.page_shape))
        assert tier.store(b"a" * 16, page) and tier.contains(b"a" * 16)
        assert torch.equal(tier.load(b"a" * 16).data, page.data)
        assert tier.load(b"b" * 16) is None and tier.stats.misses == 1 and tier.stats.errors == 0
        store.procs[1].kill()  # the store service holding the memory; the master still lists the page
        store.procs[1].wait()
        assert tier.load(b"a" * 16) is None and tier.stats.errors == 1 and tier.stats.misses == 1
        assert not tier.contains(b"a" * 16) and not tier.store(b"c" * 16, page) and tier.stats.errors == 1
    finally:
        tier.close()


async def test_greedy_identical_and_shared_with_a_new_engine(mooncake_plugin, store, tiny_models):
    path = tiny_models["llama"]
    chats = conversations(seed=21)
    want = await reference(path, chats)
    kw = dict(cache_tiers=("mooncake",), cache_page_tokens=4, cache_tier_options=store.options())
    eng = make_engine(path, **kw)
    try:
        got = await run_chats(eng, chats)
        eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["mooncake"]
    finally:
        await eng.stop()
    assert got == want
    assert st["stores"] > 0 and st["hits"] > 0 and st["tokens_loaded"] > 0 and st["errors"] == 0

    fresh = make_engine(path, **kw)  # nothing in its pool: every prefix comes from the store
    try:
        again = await run_chats(fresh, chats)
        st2 = fresh.stats()
    finally:
        await fresh.stop()
    assert again == want
    assert st2["cache_tiers"]["mooncake"]["tokens_loaded"] > st["tokens_loaded"]


async def test_store_killed_mid_run(mooncake_plugin, store, tiny_models, caplog):
    """The master and the store service die while conversations are being served (right
    after the first page came back): every request completes with the no-cache tokens."""
    path = tiny_models["llama"]
    chats = conversations(n=4, turns=3, seed=23)
    want = await reference(path, chats)
    eng = make_engine(path, cache_tiers=("mooncake",), cache_page_tokens=4, cache_write_policy="write_through",
                      cache_tier_options=store.options(retry_s=0.05))
    tier = eng.tiers.tiers[0]
    at_kill = {}

    def hook(step):
        eng.check_accounting()
        if not at_kill and tier.stats.hits > 0:
            at_kill.update(tier.stats.as_dict())
            store.kill()

    eng.step_hook = hook
    try:
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.mooncake"):
            got = await run_chats(eng, chats)
            eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["mooncake"]
    finally:
        await eng.stop()
    assert got == want
    assert at_kill and at_kill["errors"] == 0 and at_kill["stores"] > 0
    assert st["errors"] > 0 and st["hits"] == at_kill["hits"]
    assert any("failed" in r.getMessage() and "mooncake" in r.getMessage() for r in caplog.records)


async def test_corrupt_pages_are_misses(mooncake_plugin, store, tiny_models, caplog):
    """Pages overwritten in the store with flipped or truncated bytes fail their checks: never
    served (outputs equal), counted, removed, recomputed."""
    path = tiny_models["llama"]
    chats = conversations(n=2, turns=2, seed=5)
    want = await reference(path, chats)
    eng = make_engine(path, cache_tiers=("mooncake",), cache_write_policy="write_through", cache_page_tokens=4,
                      cache_tier_options=store.options())
    tier = eng.tiers.tiers[0]
    try:
        first = await run_chats(eng, [c[:1] for c in chats])
        eng.tiers.flush()
        names = sorted(tier._name(k) for k in tier._sizes)
        assert names
        for i, name in enumerate(names[::2]):  # flip a payload byte of every other page, truncate some
            blob = bytearray(tier.client.get(name))
            blob[-3] ^= 0x55
            assert tier.client.upsert(name, bytes(blob if i % 2 else blob[:30])) == 0
        assert eng.flush_cache()
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.mooncake"):
            got = await run_chats(eng, chats)
        st = eng.stats()["cache_tiers"]["mooncake"]
    finally:
        await eng.stop()
    assert first == want[:2]  # turn 0 of both conversations
    assert got == want
    assert st["corrupt"] > 0
    assert any("rejected" in r.getMessage() for r in caplog.records)


async def test_full_store_is_counted_not_fatal(mooncake_plugin, store, tiny_models, caplog):
    """A store whose memory is held by objects it may not evict (hard-pinned) refuses every
    put: counted and logged, serving goes on with outputs unchanged."""
    from mooncake.store import ReplicateConfig

    path = tiny_models["llama"]
    chats = conversations(n=3, turns=2, seed=7)
    want = await reference(path, chats)
    eng = make_engine(path, cache_tiers=("mooncake",), cache_write_policy="write_through", cache_page_tokens=4,
                      cache_tier_options=store.options())
    tier = eng.tiers.tiers[0]
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    n = 0
    for size in (1 << 20, 64 << 10, 4 << 10, 512):  # fill the 16 MB segment to the last byte it gives
        while tier.client.put(f"other:{n}", b"\0" * size, pinned) == 0:
            n += 1
    try:
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.mooncake"):
            got = await run_chats(eng, chats)
            eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["mooncake"]
    finally:
        await eng.stop()
    assert n >= 15
    assert got == want
    assert st["errors"] > 0 and st["stores"] == 0 and st["hits"] == 0
    assert any("full" in r.getMessage() for r in caplog.records)


def test_restarted_daemon_serves_old_prefixes(mooncake_plugin, store, tiny_models, tmp_path):
    """A daemon stopped and started again on the same store: its first request finds the
    prompt's pages in the store (cached tokens > 0) and answers as before."""
    toml = (f'[model]\npath = "{tiny_models["llama"]}"\n[server]\nport = 0\n[memory]\nkv_cache_tokens = 1024\n'
            '[cache]\ntiers = ["mooncake"]\nwrite_policy = "write_through"\npage_tokens = 8\n'
            f'[cache.mooncake]\nmaster_server_address = "{store.address}"\n')
    prompt = list(range(3, 103))
    outs = []
    for run in range(2):
        (tmp_path / f"run{run}").mkdir()
        d = Daemon(tmp_path / f"run{run}", toml)
        try:
            client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            outs.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
        finally:
            assert d.stop() == 0
    assert outs[0][1] == 0 and outs[1][1] == 96  # 12 whole pages of the 99 tokens looked up
    assert outs[1][0] == outs[0][0]
