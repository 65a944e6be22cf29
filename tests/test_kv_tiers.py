"""Lower KV cache tiers (host memory, disk): greedy outputs are identical with tiers on and
off while the pool is small enough to evict; pages come back from the tiers instead of being
recomputed; corrupt pages, another model's pages and failing or full disks are misses that
are logged and counted; the accounting holds after every step."""

from __future__ import annotations

import asyncio
import errno
import logging
import random

import pytest
import torch

from radixd import Engine, SamplingParams
from radixd.core.errors import ConfigError
from radixd.core.tiers import Page, PageCorrupt, TierContext, decode_page, encode_page
from radixd.core.tiers.disk import DiskTier
from radixd.core.tiers.host import HostTier

CTX = TierContext(identity="model-a", page_shape=(2, 2, 4, 2, 8), dtype=torch.float32, device=torch.device("cpu"))


def conversations(n: int = 4, turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation, the new user tokens of each turn (the prompt of turn k is every
    earlier turn, its reply and the new tokens: the multi-turn shape)."""
    rng = random.Random(seed)
    return [[[rng.randrange(2, 256) for _ in range(40 if k == 0 else 20)] for k in range(turns)] for _ in range(n)]


async def run_chats(eng: Engine, chats, max_new: int = 8) -> list[list[int]]:
    """Turn k of every conversation, round robin (the pool cannot hold them all)."""
    outs: list[list[int]] = []
    history = [[] for _ in chats]
    for k in range(len(chats[0])):
        for c, turns in enumerate(chats):
            prompt = history[c] + turns[k]
            toks: list[int] = []
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
            async for out in eng.generate(input_ids=prompt, params=params):
                toks += out.token_ids
            history[c] = prompt + toks
            outs.append(toks)
    return outs


def make_engine(path, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 256)
    eng = Engine(model=str(path), **kw)
    eng.step_hook = lambda step: eng.check_accounting()
    return eng


_REFERENCE: dict = {}


async def reference(path, chats) -> list[list[int]]:
    key = (str(path), repr(chats))
    if key not in _REFERENCE:
        eng = make_engine(path, radix_cache=False, kv_cache_tokens=4096)
        try:
            _REFERENCE[key] = await run_chats(eng, chats)
        finally:
            await eng.stop()
    return _REFERENCE[key]


# ---------------------------------------------------------------------------------------------
# Pages and tiers on their own
# ---------------------------------------------------------------------------------------------


def test_page_codec_round_trip_and_checks():
    data = torch.randn(CTX.page_shape)
    blob = encode_page(b"k" * 16, CTX.identity, Page(data))
    assert torch.equal(decode_page(blob, b"k" * 16, CTX).data, data)
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    with pytest.raises(PageCorrupt, match="checksum"):
        decode_page(bytes(flipped), b"k" * 16, CTX)
    with pytest.raises(PageCorrupt, match="another key"):
        decode_page(blob, b"j" * 16, CTX)
    other = TierContext("model-b", CTX.page_shape, CTX.dtype, CTX.device)
    with pytest.raises(PageCorrupt, match="another model"):
        decode_page(blob, b"k" * 16, other)
    with pytest.raises(PageCorrupt):
        decode_page(blob[:40], b"k" * 16, CTX)


def test_host_tier_keeps_its_limit_lru():
    tier = HostTier({"max_bytes": 3 * CTX.page_bytes}, CTX)
    for i in range(4):
        assert tier.store(bytes([i]) * 16, Page(torch.full(CTX.page_shape, float(i))))
        if i == 1:
            assert tier.load(bytes([0]) * 16) is not None  # 0 is now more recent than 1
    assert tier.stats.used_bytes == 3 * CTX.page_bytes and tier.stats.evictions == 1
    assert tier.contains(bytes([0]) * 16) and not tier.contains(bytes([1]) * 16)
    assert tier.load(bytes([1]) * 16) is None and tier.stats.misses == 1
    with pytest.raises(ConfigError, match="cache.host.max_bytes"):
        HostTier({"max_bytes": 10}, CTX)
    with pytest.raises(ConfigError, match="cache.host.size"):
        HostTier({"size": 10}, CTX)


def test_disk_tier_survives_reopen_and_trims(tmp_path):
    tier = DiskTier({"path": str(tmp_path), "max_bytes": 1 << 20}, CTX)
    page = Page(torch.randn(CTX.page_shape))
    assert tier.store(b"a" * 16, page)
    again = DiskTier({"path": str(tmp_path)}, CTX)
    assert again.contains(b"a" * 16) and torch.equal(again.load(b"a" * 16).data, page.data)
    size = again.stats.used_bytes
    small = DiskTier({"path": str(tmp_path), "max_bytes": size + 64}, CTX)  # one page (headers vary a little)
    assert small.store(b"b" * 16, page)  # the older page makes room
    assert not small.contains(b"a" * 16) and small.stats.evictions == 1
    with pytest.raises(ConfigError, match="cache.disk.path"):
        DiskTier({}, CTX)


# ---------------------------------------------------------------------------------------------
# Through the engine
# ---------------------------------------------------------------------------------------------


TIER_SETUPS = {
    "host-write-back": dict(cache_tiers=("host",)),
    "host-write-through": dict(cache_tiers=("host",), cache_write_policy="write_through"),
    "host-after-1-hit": dict(cache_tiers=("host",), cache_write_policy="write_through_hits", cache_write_hits=1),
    "disk": dict(cache_tiers=("disk",)),
    "host+disk-small-host": dict(cache_tiers=("host", "disk"), cache_write_policy="write_through"),
}


@pytest.mark.parametrize("setup", list(TIER_SETUPS))
async def test_greedy_identical_with_tiers(tiny_models, tmp_path, setup):
    path = tiny_models["llama"]
    chats = conversations()
    want = await reference(path, chats)
    kw = dict(TIER_SETUPS[setup], cache_page_tokens=4)
    opts = {}
    if "disk" in kw["cache_tiers"]:
        opts["disk"] = {"path": str(tmp_path / "kv")}
    if setup == "host+disk-small-host":
        opts["host"] = {"max_bytes": 40 * 2 * 2 * 4 * 2 * 32 * 4}  # 40 pages of tiny-llama KV
    eng = make_engine(path, cache_tier_options=opts, **kw)
    try:
        got = await run_chats(eng, chats)
        st = eng.stats()
    finally:
        await eng.stop()
    assert got == want
    assert st["tier_loaded_tokens"] > 0, st
    assert sum(t["hits"] for t in st["cache_tiers"].values()) > 0
    for name in kw["cache_tiers"]:
        assert st["cache_tiers"][name]["stores"] > 0, (name, st["cache_tiers"])
    if setup == "host+disk-small-host":
        disk = st["cache_tiers"]["disk"]  # read back directly, or prefetched into host first
        assert disk["hits"] + disk["prefetched"] > 0 and st["cache_tiers"]["host"]["evictions"] > 0


async def test_disk_tier_serves_a_new_engine(tiny_models, tmp_path):
    """An engine started on the same directory loads the old prefix instead of computing it."""
    path = tiny_models["llama"]
    prompt = [random.Random(3).randrange(2, 256) for _ in range(100)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(cache_tiers=("disk",), cache_write_policy="write_through", cache_page_tokens=8,
              cache_tier_options={"disk": {"path": str(tmp_path)}})
    outs, stats = [], []
    for _ in range(2):
        eng = make_engine(path, **kw)
        try:
            toks, cached = [], 0
            async for out in eng.generate(input_ids=prompt, params=params):
                toks += out.token_ids
                cached = out.cached_tokens
            outs.append(toks)
            stats.append((cached, eng.stats()))
        finally:
            await eng.stop()
    assert outs[0] == outs[1]
    assert stats[0][0] == 0 and stats[1][0] == 96  # 12 whole pages of the 99 looked up
    assert stats[1][1]["cache_tiers"]["disk"]["tokens_loaded"] == 96


async def test_corrupt_page_files_are_misses(tiny_models, tmp_path, caplog):
    path = tiny_models["llama"]
    chats = conversations(n=2, turns=2, seed=5)
    want = await reference(path, chats)
    kw = dict(cache_tiers=("disk",), cache_write_policy="write_through", cache_page_tokens=4,
              cache_tier_options={"disk": {"path": str(tmp_path)}})
    eng = make_engine(path, **kw)
    try:
        first = await run_chats(eng, [c[:1] for c in chats])
        eng.tiers.flush()
        files = sorted(tmp_path.glob("*/*.kv"))
        assert files
        for f in files[::2]:  # flip a byte in the payload of every other page
            blob = bytearray(f.read_bytes())
            blob[-3] ^= 0x55
            f.write_bytes(bytes(blob))
        for f in files[1::4]:  # and truncate some
            f.write_bytes(f.read_bytes()[:30])
        assert eng.flush_cache()
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.disk"):
            got = await run_chats(eng, chats)
        st = eng.stats()["cache_tiers"]["disk"]
    finally:
        await eng.stop()
    assert first == want[:2]  # turn 0 of both conversations
    assert got == want
    assert st["corrupt"] > 0
    assert any("rejected" in r.getMessage() for r in caplog.records)


async def test_full_or_failing_disk_is_counted_not_fatal(tiny_models, tmp_path, monkeypatch, caplog):
    path = tiny_models["llama"]
    chats = conversations(n=3, turns=2, seed=7)
    want = await reference(path, chats)

    def full(path, blob):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
    kw = dict(cache_tiers=("disk",), cache_write_policy="write_through", cache_page_tokens=4,
              cache_tier_options={"disk": {"path": str(tmp_path / "full")}})
    eng = make_engine(path, **kw)
    try:
        with caplog.at_level(logging.WARNING, logger="radixd.tiers.disk"):
            got = await run_chats(eng, chats)
            eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["disk"]
    finally:
        await eng.stop()
    assert got == want
    assert st["errors"] > 0 and st["stores"] == 0 and st["hits"] == 0
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "full").glob("*/.*tmp"))  # no temporary files left behind

    # a limit smaller than one page: every store is refused and counted
    monkeypatch.undo()
    kw["cache_tier_options"] = {"disk": {"path": str(tmp_path / "tiny"), "max_bytes": 100}}
    eng = make_engine(path, **kw)
    try:
        got = await run_chats(eng, chats)
        eng.tiers.flush()
        st = eng.stats()["cache_tiers"]["disk"]
    finally:
        await eng.stop()
    assert got == want and st["errors"] > 0 and st["stores"] == 0


def test_tier_configuration_is_checked(tiny_models, tmp_path):
    path = str(tiny_models["llama"])
    with pytest.raises(ConfigError, match="cache.tiers"):
        Engine(model=path, kv_cache_tokens=64, cache_tiers=("nvme",))
    with pytest.raises(ConfigError, match="cache.disk"):
        Engine(model=path, kv_cache_tokens=64, cache_tiers=("host",), cache_tier_options={"disk": {"path": "x"}})
    with pytest.raises(ConfigError, match="cache.disk.path"):
        Engine(model=path, kv_cache_tokens=64, cache_tiers=("disk",))
    with pytest.raises(ConfigError, match="cache_write_policy"):
        Engine(model=path, kv_cache_tokens=64, cache_tiers=("host",), cache_write_policy="sometimes")
    with pytest.raises(ConfigError, match="radix_cache"):
        Engine(model=path, kv_cache_tokens=64, cache_tiers=("host",), radix_cache=False)


def test_pages_of_another_model_are_misses(tiny_models, tmp_path):
    """Keys chain over the model identity: an engine of another model finds nothing."""
    async def main():
        prompt = list(range(2, 90))
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        loaded = []
        for arch in ("llama", "qwen2"):
            eng = make_engine(tiny_models[arch], cache_tiers=("disk",), cache_write_policy="write_through",
                              cache_tier_options={"disk": {"path": str(tmp_path)}})
            try:
                async for _ in eng.generate(input_ids=prompt, params=params):
                    pass
                loaded.append(eng.stats()["tier_loaded_tokens"])
            finally:
                await eng.stop()
        return loaded

    assert asyncio.run(main()) == [0, 0]


async def test_tier_metrics_in_stats_and_prometheus(tiny_models):
    from prometheus_client import generate_latest

    from radixd.server.metrics import Metrics

    eng = make_engine(tiny_models["llama"], cache_tiers=("host",), cache_page_tokens=4)
    try:
        await run_chats(eng, conversations(n=4, turns=2, seed=11))
        st = eng.stats()["cache_tiers"]["host"]
        text = generate_latest(Metrics(eng).registry).decode()
    finally:
        await eng.stop()
    assert st["hits"] > 0 and st["tokens_loaded"] > 0 and st["bytes_loaded"] > 0 and st["load_seconds"] > 0
    assert f'radixd_cache_tier_hits_total{{tier="host"}} {float(st["hits"])}' in text
    assert f'radixd_cache_tier_tokens_loaded_total{{tier="host"}} {float(st["tokens_loaded"])}' in text
    assert 'radixd_cache_tier_load_seconds_count{tier="host"}' in text
    assert 'radixd_cache_tier_used_bytes{tier="host"}' in text


def test_settings_sections_per_tier(tmp_path):
    from radixd.settings import settings_from_dict

    s = settings_from_dict({"cache": {"tiers": ["host", "disk", "redis"], "write_policy": "write_through",
                                      "host": {"max_bytes": 1 << 20}, "disk": {"path": str(tmp_path)},
                                      "redis": {"url": "redis://127.0.0.1:1/0"}}})
    cfg = s.engine_config()
    assert cfg.cache_tiers == ("host", "disk", "redis") and cfg.cache_write_policy == "write_through"
    assert cfg.cache_tier_options == {"host": {"max_bytes": 1 << 20}, "disk": {"path": str(tmp_path), "max_bytes": 16 << 30},
                                      "redis": {"url": "redis://127.0.0.1:1/0"}}
    with pytest.raises(ConfigError, match="cache.host.max_bytes"):
        settings_from_dict({"cache": {"host": {"max_bytes": 0}}})
    with pytest.raises(ConfigError, match="cache.disk.path"):
        settings_from_dict({"cache": {"tiers": ["disk"]}})
    with pytest.raises(ConfigError, match="cache.redis"):  # a table for a tier not in use
        settings_from_dict({"cache": {"tiers": ["host"], "redis": {"url": "x"}}})
    with pytest.raises(ConfigError, match="cache.write_policy"):
        settings_from_dict({"cache": {"write_policy": "never"}})
    with pytest.raises(ConfigError, match="cache.tiers"):
        settings_from_dict({"cache": {"tiers": ["host"], "radix": False}})


def test_check_config_names_a_tier_no_plugin_provides(tmp_path, capsys):
    """``radixd check-config`` checks tier names against the loaded plugins, as the daemon's
    engine does at start (the file alone cannot tell a plugin's tier from a typo)."""
    from radixd.cli import main

    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[cache]\ntiers = ["host", "nvme"]\n')
    assert main(["check-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "'cache.tiers': got 'nvme'; allowed: tiers provided by loaded plugins: disk, host" in err
    cfg.write_text('[cache]\ntiers = ["host"]\n')
    assert main(["check-config", str(cfg)]) == 0
    assert 'tiers = ["host"]' in capsys.readouterr().out


def test_radixd_bench_engine_target_with_tiers(tiny_models, tmp_path, capsys):
    """``radixd bench --engine-arg`` takes the tier list and the options table (JSON)."""
    import json

    from radixd.cli import main as radixd_main

    out = tmp_path / "tiers.json"
    common = ["bench", "--target", "engine", "--model", str(tiny_models["llama"]), "--workload", "multi-turn",
              "--conversations", "4", "--turns", "3", "--turn-len", "40", "--output-len", "4", "--no-progress",
              "--engine-arg", "kv_cache_tokens=160", "--engine-arg", "cache_tiers=host",
              "--engine-arg", "cache_page_tokens=4"]
    opts = '--engine-arg=cache_tier_options={"host": {"max_bytes": 1048576}}'
    assert radixd_main([*common, opts, "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["target"]["overrides"]["cache_tiers"] == ["host"]
    assert doc["target"]["overrides"]["cache_tier_options"] == {"host": {"max_bytes": 1048576}}
    assert all(r["ok"] for run in doc["runs"] for r in run["records"])
    capsys.readouterr()
    assert radixd_main([*common, "--engine-arg=cache_tier_options={not json"]) == 2
    assert capsys.readouterr().err.strip().startswith("radixd bench: --engine-arg")


def test_host_tier_slab_reuses_slots_lru():
    """The CUDA layout (one slab of page slots), exercised with host pages: slots are reused
    least recently used first and each page reads back what was stored."""
    ctx = TierContext("model-a", CTX.page_shape, CTX.dtype, torch.device("cuda"))
    tier = HostTier({"max_bytes": 2 * CTX.page_bytes + 5}, ctx)
    assert tier._slab is not None and tier._slab.shape[0] == 2
    for i in range(3):
        assert tier.store(bytes([i]) * 16, Page(torch.full(CTX.page_shape, float(i))))
        assert tier.store(bytes([i]) * 16, Page(torch.zeros(CTX.page_shape)))  # already held: kept
    assert not tier.contains(bytes([0]) * 16) and tier.stats.evictions == 1
    assert torch.equal(tier.load(bytes([1]) * 16).data, torch.full(CTX.page_shape, 1.0))
    assert torch.equal(tier.load(bytes([2]) * 16).data, torch.full(CTX.page_shape, 2.0))
    assert tier.stats.used_bytes == 2 * CTX.page_bytes
    tier.evict(bytes([1]) * 16)
    assert tier.store(bytes([3]) * 16, Page(torch.full(CTX.page_shape, 3.0)))
    assert torch.equal(tier.load(bytes([2]) * 16).data, torch.full(CTX.page_shape, 2.0))
    assert torch.equal(tier.load(bytes([3]) * 16).data, torch.full(CTX.page_shape, 3.0))
