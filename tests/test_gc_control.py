"""The garbage collector while engines run: start-up objects frozen out of its walks, the
young threshold raised, both undone when the last engine stops; pauses counted."""

from __future__ import annotations

import gc

import pytest
from test_engine import make_engine

from radixd import SamplingParams
from radixd.core import gc_control
from radixd.core.errors import ConfigError


async def test_running_engines_freeze_and_restore_the_collector(tiny_models):
    before_threshold = gc.get_threshold()
    gc.unfreeze()
    a = make_engine(tiny_models["llama"], gc_threshold=before_threshold[0] + 20000)
    b = make_engine(tiny_models["llama"])
    try:
        await a.start()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == before_threshold[0] + 20000
        await b.start()
        out = [o async for o in a.generate("hello", params=SamplingParams(max_new_tokens=4, temperature=0.0))]
        assert out[-1].finished
        gc.collect()
        st = a.stats()["gc"]
        assert st["collections"] >= 1 and st["full_collections"] >= 1
        assert 0 < st["max_pause_seconds"] <= st["pause_seconds"]
        await a.stop()
        # b still runs: the settings stay (the frozen objects put back until the next full collection)
        assert gc.get_threshold()[0] == before_threshold[0] + 20000
        gc.collect()
        assert gc.get_freeze_count() > 0
    finally:
        await a.stop()
        await b.stop()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before_threshold
    assert gc_control.pauses()["collections"] >= st["collections"]  # still readable after


async def test_collector_left_alone_when_switched_off(tiny_models):
    before_threshold = gc.get_threshold()
    gc.unfreeze()
    eng = make_engine(tiny_models["llama"], gc_freeze=False, gc_threshold=0)
    try:
        await eng.start()
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before_threshold
    finally:
        await eng.stop()


@pytest.mark.parametrize("key,value", [("gc_freeze", "yes"), ("gc_threshold", -1), ("gc_threshold", True)])
def test_gc_settings_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        make_engine("unused", **{key: value})


async def test_an_engine_stopped_beside_a_running_one_is_freed(tiny_models):
    """Stopping one engine while another runs puts the frozen objects back: the stopped
    engine's cycles go with the next full collection, and what survives it is frozen again."""
    import weakref

    gc.unfreeze()
    a = make_engine(tiny_models["llama"])
    b = make_engine(tiny_models["llama"])
    try:
        await a.start()
        await b.start()
        out = [o async for o in b.generate("hello", params=SamplingParams(max_new_tokens=2, temperature=0.0))]
        assert out[-1].finished
        await b.stop()
        gone = weakref.ref(b.replicas[0].worker.model)
        del b, out
        gc.collect()
        assert gone() is None  # (frozen, the stopped engine's model stayed while a ran)
        assert gc.get_freeze_count() > 0  # the survivors, a's among them, frozen again
        out = [o async for o in a.generate("hello", params=SamplingParams(max_new_tokens=2, temperature=0.0))]
        assert out[-1].finished
    finally:
        await a.stop()
    assert gc.get_freeze_count() == 0
