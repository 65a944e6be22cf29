"""Scheduling policies are plugins: the built-ins load through pluggy, and an outside policy
registered as a plugin object is used without touching the scheduler."""

from __future__ import annotations

import asyncio

import pytest

from radixd import Engine, SamplingParams
from radixd.core.errors import ConfigError
from radixd.plugins import hookimpl, make_plugin_manager
from radixd.plugins.policies import FCFS, LongestPrefixMatch


def test_builtin_policies_are_plugins():
    pm = make_plugin_manager(load_entry_points=False)
    names = dict(pm.list_name_plugin())
    assert "radixd.plugins.policies" in names
    provided = {}
    for d in pm.hook.radixd_schedule_policies():
        provided.update(d)
    assert provided["fcfs"] is FCFS and provided["lpm"] is LongestPrefixMatch


class LongestPromptFirst:
    """An outside policy: admit the longest prompt first."""

    name = "longest-first"
    calls = 0

    def __init__(self, config):
        self.config = config

    def order(self, waiting, ctx):
        type(self).calls += 1
        return sorted(waiting, key=lambda r: (-len(r.prompt_ids), r.arrival))


class OutsidePlugin:
    @hookimpl
    def radixd_schedule_policies(self):
        return {"longest-first": LongestPromptFirst}


async def test_outside_policy_is_used(tiny_models):
    pm = make_plugin_manager(load_entry_points=False, extra=[OutsidePlugin()])
    eng = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=2048, policy="longest-first",
                 plugin_manager=pm, max_running_requests=1)
    admitted = []
    eng.step_hook = lambda step: admitted.extend(r.rid for r in step.reqs if r.rid not in admitted)
    try:
        async def one(rid, n):
            async for _ in eng.generate(input_ids=list(range(2, 2 + n)), rid=rid,
                                        params=SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)):
                pass

        # all four queue up together; one runs at a time, so admission order is the policy's
        await asyncio.gather(one("block", 5), one("short", 10), one("long", 40), one("mid", 20))
        assert isinstance(eng.policy, LongestPromptFirst)
        assert LongestPromptFirst.calls > 0
        assert admitted == ["long", "mid", "short", "block"]  # fcfs/lpm would start with "block"
    finally:
        await eng.stop()


def test_unknown_policy_is_refused(tiny_models):
    with pytest.raises(ConfigError) as e:
        Engine(model=str(tiny_models["llama"]), kv_cache_tokens=256, policy="nope",
               plugin_manager=make_plugin_manager(load_entry_points=False))
    assert "policy" in str(e.value) and "fcfs" in str(e.value) and "lpm" in str(e.value)
