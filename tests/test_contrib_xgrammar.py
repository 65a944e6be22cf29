"""The contrib grammar backend ``plugins-contrib/radixd-xgrammar``, installed for real with pip:
found through the ``radixd`` entry-point group and used by an engine in place of the built-in
backend (``grammar_backend="xgrammar"``)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import pip_install_contrib

from radixd import Engine, SamplingParams
from radixd.core.errors import InvalidRequest
from radixd.plugins import make_plugin_manager

pytest.importorskip("xgrammar", reason="xgrammar is in the test extra; it did not install here")

DIST = "radixd-xgrammar"


@pytest.fixture(scope="module")
def xgrammar_plugin(tmp_path_factory):
    yield from pip_install_contrib(DIST, "xgrammar", tmp_path_factory.mktemp("contrib"))


async def test_xgrammar_backend_constrains_generation(xgrammar_plugin, tiny_models):
    pm = make_plugin_manager(allow=["xgrammar"])
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=8000, plugin_manager=pm,
                    grammar_backend="xgrammar")
    try:
        assert type(engine.grammars.backend).__module__ == "radixd_xgrammar"
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                  "required": ["ok", "n"]}
        params = SamplingParams(json_schema=schema, max_new_tokens=60, temperature=1.0, seed=4, n=2)
        outs = [o async for o in engine.generate("json:", params=params)]
        texts: dict[int, str] = {}
        for o in outs:
            texts[o.index] = texts.get(o.index, "") + o.text
        done = [o for o in outs if o.finished]
        assert len(done) == 2
        for o in done:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(texts[o.index]), schema)
        params = SamplingParams(regex=r"[0-9]{2}-[a-c]{2}", max_new_tokens=20, temperature=1.0, seed=1)
        text = "".join([o.text async for o in engine.generate("x", params=params)])
        assert re.fullmatch(r"[0-9]{2}-[a-c]{2}", text), text
        with pytest.raises(InvalidRequest) as info:
            await engine.compile_grammar(SamplingParams(ebnf="start: A\nA: /a/"))
        assert info.value.field == "ebnf"
        with pytest.raises(InvalidRequest, match="xgrammar"):
            await engine.compile_grammar(SamplingParams(regex="(a"))
    finally:
        await engine.stop()
