"""The contrib plugin ``plugins-contrib/radixd-priority``, installed for real with pip: found
through the ``radixd`` entry-point group, listed by ``radixd plugins``, honouring allow/block,
and changing the order in which an engine admits requests."""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import pip_install_contrib

from radixd import Engine, SamplingParams
from radixd.core.config import EngineConfig
from radixd.core.errors import ConfigError
from radixd.core.request import Request
from radixd.plugins import make_plugin_manager

PLUGIN_SRC = Path(__file__).resolve().parent.parent / "plugins-contrib" / "radixd-priority"
DIST = "radixd-priority"
AGING_ENV = "RADIXD_PRIORITY_AGING_STEPS"


@pytest.fixture(scope="session")
def priority_plugin(tmp_path_factory):
    """pip-install the plugin (not editable) into this environment; yield its module.

    It is built from a copy so the checkout gets no build/ or egg-info litter, and it is
    uninstalled afterwards unless it was installed before the session.
    """
    assert (PLUGIN_SRC / "pyproject.toml").is_file(), PLUGIN_SRC
    for module in pip_install_contrib(DIST, "priority", tmp_path_factory.mktemp("contrib")):
        where = Path(importlib.metadata.distribution(DIST).locate_file("")).resolve()
        assert Path(module.__file__).resolve().is_relative_to(where)
        yield module


def _cli_plugins(*args: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "radixd", *args, "plugins"], capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split("\t", 1) for line in out.splitlines() if line)


# the radixd.toml files the CLI tests list the plugins under (None: no --config)
CLI_CONFIGS = (None, "[plugins]\nallow = []\n", '[plugins]\nallow = ["priority"]\n', '[plugins]\nblock = ["priority"]\n',
               '[plugins]\nallow = ["something-else"]\n', "[plugins]\nentry_points = false\n")


@pytest.fixture(scope="module")
def cli_rows(priority_plugin, tmp_path_factory) -> dict[str | None, dict[str, str]]:
    """``radixd [--config FILE] plugins`` for each of CLI_CONFIGS, a process each, all at once
    (each spends seconds importing; one after the other they took half a minute)."""
    tmp = tmp_path_factory.mktemp("cli")

    def rows(numbered: tuple[int, str | None]) -> dict[str, str]:
        i, toml = numbered
        if toml is None:
            return _cli_plugins()
        cfg = tmp / f"radixd{i}.toml"
        cfg.write_text(toml)
        return _cli_plugins("--config", str(cfg))

    with ThreadPoolExecutor(len(CLI_CONFIGS)) as pool:
        return dict(zip(CLI_CONFIGS, pool.map(rows, enumerate(CLI_CONFIGS)), strict=True))


def _policies(pm) -> dict[str, type]:
    table: dict[str, type] = {}
    for provided in pm.hook.radixd_schedule_policies():
        table.update(provided or {})
    return table


# ---------------------------------------------------------------------------------------------
# Installation and discovery
# ---------------------------------------------------------------------------------------------


def test_installed_not_editable(priority_plugin):
    where = Path(priority_plugin.__file__).resolve()
    assert where.name == "__init__.py" and where.parent.name == "radixd_priority"
    assert not where.is_relative_to(PLUGIN_SRC.resolve())  # a real install, not the checkout
    assert priority_plugin.PriorityPolicy.name == "priority"


def test_cli_lists_it_with_its_location(priority_plugin, cli_rows):
    rows = cli_rows[None]
    assert "radixd.plugins.policies" in rows  # the built-ins still load
    assert "priority" in rows, rows
    assert Path(rows["priority"]).resolve() == Path(priority_plugin.__file__).resolve()


def test_cli_honours_plugins_settings(priority_plugin, cli_rows):
    where = str(Path(priority_plugin.__file__).resolve())

    def rows_with(toml: str) -> dict[str, str]:
        return cli_rows[toml]

    # In radixd.toml an empty allow list means "every installed plugin" (documented there).
    assert rows_with("[plugins]\nallow = []\n").get("priority") == where
    assert rows_with('[plugins]\nallow = ["priority"]\n').get("priority") == where
    # Blocked, filtered out or with entry points off, it is not loaded from its module.
    assert rows_with('[plugins]\nblock = ["priority"]\n').get("priority") != where
    assert rows_with('[plugins]\nallow = ["something-else"]\n').get("priority") != where
    assert "priority" not in rows_with("[plugins]\nentry_points = false\n")


def test_cli_does_not_list_blocked_plugin(priority_plugin, cli_rows):
    assert "priority" not in cli_rows['[plugins]\nblock = ["priority"]\n']


def test_allow_and_block(priority_plugin, tiny_models):
    def loaded(pm) -> bool:
        plugin = pm.get_plugin("priority")
        assert plugin is None or plugin is priority_plugin
        in_table = _policies(pm).get("priority") is priority_plugin.PriorityPolicy
        assert in_table == (plugin is not None)
        builtins = _policies(pm)
        assert "fcfs" in builtins and "lpm" in builtins  # built-ins are never filtered
        return plugin is not None

    assert loaded(make_plugin_manager())                          # allow=None: every entry point
    assert loaded(make_plugin_manager(allow=["priority"]))
    assert not loaded(make_plugin_manager(allow=[]))              # an empty allow list: none
    assert not loaded(make_plugin_manager(allow=["something-else"]))
    assert not loaded(make_plugin_manager(block=["priority"]))
    assert not loaded(make_plugin_manager(allow=["priority"], block=["priority"]))  # block wins
    assert not loaded(make_plugin_manager(load_entry_points=False))
    assert make_plugin_manager(block=["priority"]).is_blocked("priority")

    # An engine whose plugin manager blocks it refuses the policy name and says what exists.
    with pytest.raises(ConfigError) as e:
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, policy="priority",
               plugin_manager=make_plugin_manager(block=["priority"]))
    assert "policy" in str(e.value) and "fcfs" in str(e.value) and "priority" not in e.value.allowed
    # ... and so does one configured to block it.
    with pytest.raises(ConfigError):
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, policy="priority", plugins_block=("priority",))


# ---------------------------------------------------------------------------------------------
# Behaviour in an engine
# ---------------------------------------------------------------------------------------------


async def _admission_order(model: Path, policy: str, jobs: list[tuple[str, list[int], int]],
                           warm: list[int] | None = None) -> tuple[list[str], object]:
    """Submit ``jobs`` (rid, prompt ids, priority) at once to an engine running one request at
    a time; return the order in which they were admitted and the engine's policy object."""
    eng = Engine(model=str(model), kv_cache_tokens=2048, policy=policy, max_running_requests=1)
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)

    async def drain(sub) -> None:
        async for _ in sub:
            pass

    try:
        if warm is not None:  # put a prefix in the radix cache first
            await drain(eng.submit(input_ids=warm, params=params, rid="warm"))
        admitted: list[str] = []
        eng.step_hook = lambda step: admitted.extend(r.rid for r in step.reqs if r.rid not in admitted)
        subs = [eng.submit(input_ids=ids, rid=rid, params=params, priority=p) for rid, ids, p in jobs]
        await asyncio.gather(*(drain(s) for s in subs))
        return admitted, eng.policy
    finally:
        await eng.stop()


def _prompt(i: int, n: int = 12) -> list[int]:
    return [2 + 16 * i + k for k in range(n)]  # distinct first tokens: no shared prefixes


JOBS = [("low-a", _prompt(0), 0), ("mid", _prompt(1), 5), ("high", _prompt(2), 9),
        ("low-b", _prompt(3), 0), ("top", _prompt(4), 20), ("neg", _prompt(5), -3)]


async def test_engine_admits_by_priority(priority_plugin, tiny_models, monkeypatch):
    monkeypatch.delenv(AGING_ENV, raising=False)  # the default aging: far slower than this test
    order, policy = await _admission_order(tiny_models["llama"], "priority", JOBS)
    assert isinstance(policy, priority_plugin.PriorityPolicy)
    assert policy.aging_steps == priority_plugin.DEFAULT_AGING_STEPS
    assert order == ["top", "high", "mid", "low-a", "low-b", "neg"]  # equal priority: arrival


async def test_engine_fcfs_ignores_priority(priority_plugin, tiny_models):
    order, _ = await _admission_order(tiny_models["llama"], "fcfs", JOBS)
    assert order == [rid for rid, _, _ in JOBS]


async def test_engine_ties_prefer_cached_prefix(priority_plugin, tiny_models, monkeypatch):
    monkeypatch.setenv(AGING_ENV, "0")
    shared = _prompt(7, 40)
    jobs = [("cold", _prompt(0, 44), 1), ("hot", shared + [3, 4, 5, 6], 1), ("urgent", _prompt(1, 44), 2)]
    order, _ = await _admission_order(tiny_models["llama"], "priority", jobs, warm=shared)
    assert order == ["urgent", "hot", "cold"]


async def test_engine_refuses_bad_aging_variable(priority_plugin, tiny_models, monkeypatch):
    monkeypatch.setenv(AGING_ENV, "soon")
    with pytest.raises(ConfigError) as e:
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, policy="priority")
    assert AGING_ENV in str(e.value) and "'soon'" in str(e.value)


# ---------------------------------------------------------------------------------------------
# The policy object on its own
# ---------------------------------------------------------------------------------------------


class FakeCache:
    def __init__(self, hits: dict[str, int] | None = None):
        self.hits = hits or {}
        self.peeked: list[int] = []

    def peek_prefix_len(self, seq, namespace=0) -> int:
        self.peeked.append(seq[0])
        return self.hits.get(seq[0], 0)


class FakeCtx:
    def __init__(self, cache: FakeCache):
        self.cache = cache
        self.prefilling: list[Request] = []


def _req(rid: str, priority: int, arrival: int, first_token: int | None = None) -> Request:
    tok = arrival if first_token is None else first_token
    return Request(rid, [tok, 1, 1], SamplingParams(max_new_tokens=1), seed=0, arrival=arrival, priority=priority)


def _policy(plugin, monkeypatch, steps: str | None):
    if steps is None:
        monkeypatch.delenv(AGING_ENV, raising=False)
    else:
        monkeypatch.setenv(AGING_ENV, steps)
    return plugin.PriorityPolicy(EngineConfig())


def test_policy_orders_priority_then_prefix_then_arrival(priority_plugin, monkeypatch):
    pol = _policy(priority_plugin, monkeypatch, "0")
    reqs = [_req("a", 1, 0), _req("b", 1, 1), _req("c", 1, 2), _req("d", 3, 3), _req("e", -1, 4), _req("f", 3, 5)]
    cache = FakeCache({1: 5, 2: 9})  # b and c have cached prefixes, c the longer
    assert [r.rid for r in pol.order(reqs, FakeCtx(cache))] == ["d", "f", "c", "b", "a", "e"]
    assert 4 not in cache.peeked  # a priority nobody shares needs no cache look-up


@pytest.mark.parametrize(("steps", "prio"), [(1, 1), (2, 2), (3, 4)])
def test_aging_lets_a_low_priority_request_through(priority_plugin, monkeypatch, steps, prio):
    """A priority-0 request waits behind a steady stream of priority-``prio`` arrivals (one
    admitted per call); it gains 1 per ``steps`` calls and wins the tie by arrival once its
    effective priority reaches ``prio``: on call 1 + steps * prio."""
    pol = _policy(priority_plugin, monkeypatch, str(steps))
    ctx = FakeCtx(FakeCache())
    old = _req("old", 0, 0)
    waiting = [old]
    for call in range(1, 100):
        waiting.append(_req(f"new{call}", prio, call))
        first = pol.order(waiting, ctx)[0]
        if first is old:
            break
        assert pol.effective_priority(old) == (call - 1) // steps < prio
        waiting.remove(first)
    else:
        pytest.fail("the old request never got through")
    assert call == 1 + steps * prio
    assert pol.effective_priority(old) == prio
    # once admitted it leaves the queue; should it come back (preempted) it ages from zero
    waiting.remove(old)
    pol.order(waiting, ctx)
    assert pol.effective_priority(old) == 0
    pol.order([old], ctx)
    assert pol.effective_priority(old) == 0


def test_no_aging_is_strict(priority_plugin, monkeypatch):
    pol = _policy(priority_plugin, monkeypatch, "0")
    ctx = FakeCtx(FakeCache())
    old = _req("old", 0, 0)
    waiting = [old]
    for call in range(1, 500):
        waiting.append(_req(f"new{call}", 1, call))
        first = pol.order(waiting, ctx)[0]
        assert first is not old
        waiting.remove(first)
    assert pol.effective_priority(old) == 0


@pytest.mark.parametrize(("raw", "steps"), [(None, "default"), ("", "default"), ("  ", "default"), ("0", 0),
                                            ("7", 7), (" 12 ", 12), ("100000", 100000)])
def test_aging_variable_accepted(priority_plugin, monkeypatch, raw, steps):
    pol = _policy(priority_plugin, monkeypatch, raw)
    assert pol.aging_steps == (priority_plugin.DEFAULT_AGING_STEPS if steps == "default" else steps)


@pytest.mark.parametrize("raw", ["-1", "abc", "1.5", "10s", "0x10", "1e3", "+-3"])
def test_aging_variable_refused(priority_plugin, monkeypatch, raw):
    with pytest.raises(ConfigError) as e:
        _policy(priority_plugin, monkeypatch, raw)
    msg = str(e.value)
    assert AGING_ENV in msg and repr(raw) in msg and ">= 0" in msg
    assert isinstance(e.value, ValueError)
