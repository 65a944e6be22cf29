"""Structural tags and ``grammar_after`` (radixd/grammars/structural_tag.py, triggers.py):
trigger scans on a hand-made vocabulary (special-token and plain-text triggers, tokens that
straddle a trigger), the default model's tokenizer, and constrained generation on the
random-weight model whose structures parse and validate."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from radixd import Engine
from radixd.core.errors import InvalidRequest
from radixd.core.sampling_params import Constraint, SamplingParams
from radixd.grammars import GrammarError
from radixd.grammars.automaton import TokenGrammar
from radixd.grammars.backend import RadixdBackend
from radixd.grammars.lexers import SharedLexers, Terminal
from radixd.grammars.parsers import SingleTerminalParser
from radixd.grammars.service import GrammarService
from radixd.grammars.structural_tag import compile_structural_tag
from radixd.grammars.triggers import AfterText
from radixd.grammars.vocab import TokenizerInfo

DEFAULT_MODEL = Path.home() / ".cache" / "radixd" / "models" / "SmolLM2-135M-Instruct"
EOS, PY_TAG, TOOL_CALLS = 256, 257, 258  # special tokens of the hand-made vocabulary
MULTI = [b"<tool", b"_call>", b"call>\n", b"<tool_call>", b'{"', b'":', b'":"', b'"}', b"}\n", b'name', b' "',
         b"</think>", b"think>\n"]
ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}


def _vocab() -> TokenizerInfo:
    toks = [bytes([b]) for b in range(256)] + [None, None, None] + MULTI
    special = {EOS: b"</s>", PY_TAG: b"<|python_tag|>", TOOL_CALLS: b"[TOOL_CALLS]"}
    return TokenizerInfo(toks, len(toks), (EOS,), special)


def _tag(vocab: TokenizerInfo, structures: list[dict], triggers: list[str]):
    spec = json.dumps({"type": "structural_tag", "structures": structures, "triggers": triggers})
    return compile_structural_tag(spec, vocab, max_ws=2, mask_cache_size=64, shared=SharedLexers(),
                                  warm_budget_s=0.01)


def _id(vocab: TokenizerInfo, piece: bytes) -> int:
    return vocab.token_bytes.index(piece)


def _walk(m, vocab: TokenizerInfo, ids: list[int]) -> np.ndarray:
    """Feed ``ids`` checking each was allowed by the mask; the mask after them."""
    row = np.zeros(vocab.vocab_size, dtype=bool)
    for t in ids:
        m.fill_mask(row)
        assert row[t], (t, vocab.token_bytes[t] or vocab.special.get(t))
        assert m.accept_token(t)
    m.fill_mask(row)
    return row


def _bytes(vocab: TokenizerInfo, text: bytes) -> list[int]:
    return list(text)  # ids 0..255 are the single bytes


def test_special_token_trigger_opens_its_structure():
    """Llama's <|python_tag|> as one special token: free text (EOS allowed), then the rest of
    begin, JSON valid for the schema and end exactly (no EOS inside), then free text again."""
    v = _vocab()
    tag = _tag(v, [{"begin": '<|python_tag|>{"name": "weather", "parameters": ', "schema": ARGS, "end": "}"}],
               ["<|python_tag|>"])
    m = tag.matcher()
    row = _walk(m, v, _bytes(v, b"Let me check. "))
    assert row.all()  # free text: every token, EOS and special tokens included
    row = _walk(m, v, [PY_TAG])
    assert set(np.flatnonzero(row)) == {ord("{"), _id(v, b'{"')}  # only the rest of begin: no EOS
    row = _walk(m, v, _bytes(v, b'{"name": "weather", "parameters": '))
    assert not row[EOS] and row[ord("{")] and not row[PY_TAG]
    row = _walk(m, v, _bytes(v, b'{"city": "Oslo", "days": 3}'))
    assert row.sum() == 1 and row[ord("}")]  # end, exactly: no whitespace before it
    row = _walk(m, v, _bytes(v, b"}"))
    assert row.all() and not m.is_terminated()
    m2 = tag.matcher()
    _walk(m2, v, [PY_TAG] + _bytes(v, b'{"name": "weather", "parameters": {'))
    assert not m2.accept_token(ord("}"))  # "city" is required


def test_plain_text_trigger_and_straddling_tokens():
    """A trigger spelt over several tokens works; a token that completes it before its last
    byte (it would run past the trigger) is masked out; one ending with it is allowed."""
    v = _vocab()
    tag = _tag(v, [{"begin": '<tool_call>\n{"name": "weather", "arguments": ', "schema": ARGS, "end": "}\n</tool_call>"}],
               ["<tool_call>"])
    m = tag.matcher()
    row = _walk(m, v, _bytes(v, b"ok "))
    assert row[_id(v, b"<tool_call>")] and row[_id(v, b"<tool")] and row[_id(v, b"call>\n")]
    row = _walk(m, v, [_id(v, b"<tool"), ord("_")])
    assert not row[_id(v, b"call>\n")]  # would complete the trigger and run on: masked out
    assert row[ord("c")] and row[EOS]
    row = _walk(m, v, _bytes(v, b"call>"))
    assert row.sum() == 1 and row[ord("\n")]  # in the structure: the rest of begin
    m = tag.matcher()
    row = _walk(m, v, [_id(v, b"<tool_call>"), ord("\n"), _id(v, b'{"'), _id(v, b"name"), _id(v, b'":'),
                       _id(v, b' "')] + _bytes(v, b'weather", "arguments": {"city": "x"}'))
    assert row[_id(v, b"}\n")] and not row[EOS]
    row = _walk(m, v, [_id(v, b"}\n")] + _bytes(v, b"</tool_call>"))
    assert row.all()  # free again
    # a token that completes the end and runs on is masked out
    m = tag.matcher()
    row = _walk(m, v, [_id(v, b"<tool_call>")] + _bytes(v, b'\n{"name": "weather", "arguments": {"city": "x"}}\n</tool_'))
    assert row.sum() == 1 and row[ord("c")] and not row[_id(v, b"call>\n")]
    # a plain-text trigger made of JSON itself: {"name": (the Llama JSON style without a tag)
    tag = _tag(v, [{"begin": '{"name": "weather", "parameters": ', "schema": ARGS, "end": "}"}], ['{"name":'])
    m = tag.matcher()
    row = _walk(m, v, [_id(v, b'{"'), _id(v, b"name")])
    assert row[_id(v, b'":')] and not row[_id(v, b'":"')]  # '":"' would run past the trigger
    row = _walk(m, v, [_id(v, b'":')])
    assert set(np.flatnonzero(row)) == {ord(" "), _id(v, b' "')}  # the rest of begin


def test_several_triggers_and_structures():
    v = _vocab()
    other = {"type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"]}
    tag = _tag(v, [{"begin": "[TOOL_CALLS]weather:", "schema": ARGS, "end": ";"},
                   {"begin": "[TOOL_CALLS]search:", "schema": other, "end": ";"},
                   {"begin": "<tool_call>", "schema": None, "end": "</tool_call>"}],
               ["[TOOL_CALLS]", "<tool_call>"])
    m = tag.matcher()
    row = _walk(m, v, [TOOL_CALLS])
    assert row[ord("w")] and row[ord("s")] and row.sum() == 2
    row = _walk(m, v, _bytes(v, b'search:{"q":"b"}'))
    assert row.sum() == 1 and row[ord(";")]
    row = _walk(m, v, _bytes(v, b';') + [_id(v, b"<tool_call>")] + _bytes(v, b'[1, {"x": null}]</tool_call>'))
    assert row.all()  # a null schema: any JSON value
    m = tag.matcher()
    _walk(m, v, [TOOL_CALLS] + _bytes(v, b'search:{"q":'))
    assert not m.accept_token(ord("1"))


@pytest.mark.parametrize("spec, message", [
    ({"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b>"]}, "exactly one trigger"),
    ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a>", "<c>"]}, "opens no structure"),
    ({"structures": [{"begin": "<ab>", "end": "."}, {"begin": "<a", "end": "."}], "triggers": ["<a", "<ab"]},
     "is part of trigger"),
    ({"structures": [{"begin": "x<a>", "end": "."}], "triggers": ["<a>", "x<a>"]}, "is part of trigger"),
    ({"structures": [{"begin": "<a>", "schema": {"type": "string", "frobnicate": 1}, "end": "."}],
      "triggers": ["<a>"]}, "'frobnicate'"),
    ({"structures": [], "triggers": ["<a>"]}, "'structures'"),
    ({"structures": [{"begin": "<a>", "end": "."}], "triggers": []}, "'triggers'"),
    ({"structures": [{"begin": "<a>", "end": ".", "extra": 1}], "triggers": ["<a>"]}, "extra"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format'"),
    ({"type": "json_schema", "structures": [], "triggers": []}, "'type'"),
    ("{nope", "not valid JSON"),
])
def test_bad_structural_tags_are_refused(spec, message):
    with pytest.raises(GrammarError) as info:
        compile_structural_tag(spec if isinstance(spec, str) else json.dumps(spec), _vocab(), max_ws=2,
                               mask_cache_size=8, shared=SharedLexers(), warm_budget_s=0.0)
    assert info.value.field == "structural_tag" and message in info.value.message


def test_grammar_after_frees_the_text_before_the_marker():
    """Before the first </think>: every token (EOS too), but one running past the marker;
    after it: the grammar's own mask, of any kind (here a regex)."""
    v = _vocab()
    regex = TokenGrammar([Terminal("REGEX", "[0-9]{2}")], SingleTerminalParser(), v)

    class Compiled:
        def matcher(self):
            from radixd.grammars.automaton import Matcher
            return Matcher(regex)

    after = AfterText(Compiled(), "</think>", v)
    m = after.matcher()
    row = _walk(m, v, _bytes(v, b"hmm, <"))
    assert row.all() and not m.is_terminated()
    row = _walk(m, v, _bytes(v, b"/"))
    assert row[ord("t")] and not row[_id(v, b"think>\n")] and row[EOS]  # it would run past the marker
    row = _walk(m, v, _bytes(v, b"think"))
    row = _walk(m, v, _bytes(v, b">"))
    assert row.sum() == 10 and row[ord("7")] and not row[EOS]  # the regex from here on
    row = _walk(m, v, _bytes(v, b"42"))
    assert m.is_terminated() and row[EOS]
    m = after.matcher()
    row = _walk(m, v, [_id(v, b"</think>")])
    assert row.sum() == 10


def test_sampling_params_fields():
    p = SamplingParams(structural_tag={"structures": [], "triggers": []}, grammar_after="</think>")
    assert p.constraint == Constraint("structural_tag", '{"structures": [], "triggers": []}', "</think>")
    assert SamplingParams(regex="a", grammar_after="x").constraint == ("regex", "a", "x")
    assert SamplingParams(grammar_after="x").constraint is None  # nothing to apply after it
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(json_schema={}, structural_tag="{}")
    assert info.value.field == "structural_tag"
    for bad in ("", 3):
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(regex="a", grammar_after=bad)
        assert info.value.field == "grammar_after"
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(structural_tag=["x"])
    assert info.value.field == "structural_tag"


# ------------------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    if not DEFAULT_MODEL.exists():
        pytest.skip("the default model is not cached (radixd pull)")
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    return tok, RadixdBackend(None, tokenizer=tok, vocab_size=49152, eos_ids=(2,))


QWEN = {"structures": [{"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": ARGS,
                        "end": "}\n</tool_call>"},
                       {"begin": '<tool_call>\n{"name": "search", "arguments": ',
                        "schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
                        "end": "}\n</tool_call>"}],
        "triggers": ["<tool_call>"]}


def _feed(tok, m, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` allowed, EOS allowed after it)."""
    row = np.zeros(49152, dtype=bool)
    for t in tok(text).input_ids:
        m.fill_mask(row)
        if not row[t] or not m.accept_token(t):
            return False, False
    m.fill_mask(row)
    return True, bool(row[2])


def test_default_model_tokenizer(smol):
    tok, backend = smol
    tag = backend.compile("structural_tag", json.dumps(QWEN))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    assert _feed(tok, tag.matcher(), "Sure. " + call + "\nDone.") == (True, True)
    assert _feed(tok, tag.matcher(), call + "\n" + call) == (True, True)  # parallel calls
    assert _feed(tok, tag.matcher(), call[:-3]) == (True, False)  # inside a structure: no EOS
    assert _feed(tok, tag.matcher(), "<tool_call>\n{\"name\": \"get_time\"")[0] is False
    assert _feed(tok, tag.matcher(), '<tool_call>\n{"name": "search", "arguments": {"q": 1}')[0] is False
    assert _feed(tok, tag.matcher(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                     '"days": 9}}\n</tool_call>')[0] is False  # maximum 7
    service = GrammarService(backend, workers=1, timeout_s=30, cache_size=8, vocab=lambda: backend.vocab)
    try:
        after = service.compile_now("json_schema", json.dumps(ARGS), "</think>")
        assert service.compile_now("json_schema", json.dumps(ARGS), "</think>") is after
        m = after.matcher()
        assert _feed(tok, m, "<think>The user wants JSON, so") == (True, True)
        assert _feed(tok, m, '.</think>{"city": "Rome"}') == (True, True) and m.is_terminated()
        assert _feed(tok, after.matcher(), '</think>{"city": 5}')[0] is False
    finally:
        service.shutdown()


# ------------------------------------------------------------------------------- the engine

PAD = 1  # the tiny tokenizer's <pad>: a special token, here the trigger / marker


def _structures(text: str, begins: dict[str, dict], end: str) -> tuple[int, bool]:
    """Check every structure of ``text`` (after each <pad>): one of ``begins``, a JSON
    document valid for its schema, ``end``. (complete structures, whether the text ends in
    free text)."""
    pieces = text.split("<pad>")
    done = 0
    for i, piece in enumerate(pieces[1:]):
        begin = next((b for b in begins if piece.startswith(b) or b.startswith(piece)), None)
        assert begin is not None, piece
        if not piece.startswith(begin) or len(piece) == len(begin):
            assert i == len(pieces) - 2  # cut short by max_tokens
            return done, False
        try:
            rest = piece[len(begin):]
            doc, at = json.JSONDecoder().raw_decode(piece, len(piece) - len(rest.lstrip(" \t\n\r")))
        except json.JSONDecodeError:
            assert i == len(pieces) - 2, piece
            return done, False
        jsonschema.validate(doc, begins[begin])
        if not piece[at:].startswith(end):
            assert i == len(pieces) - 2 and end.startswith(piece[at:]), piece
            return done, False
        done += 1
    return done, True


async def test_engine_structural_tag_outputs_validate(tiny_models):
    """Greedy and sampled, the random-weight model pushed towards the trigger: every
    structure parses and validates; EOS comes only in free text."""
    search = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}, "n": {"type": "boolean"}},
              "required": ["q", "n"]}
    begins = {'{"name": "weather", "arguments": ': ARGS, '{"name": "search", "arguments": ': search}
    spec = {"type": "structural_tag", "triggers": ["<pad>"],
            "structures": [{"begin": "<pad>" + b, "schema": s, "end": "} ."} for b, s in begins.items()]}
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=20000, grammar_compile_memory_mb=0)
    try:
        async def one(seed: int) -> tuple[str, str]:
            params = SamplingParams(structural_tag=spec, max_new_tokens=120, temperature=0.0 if seed == 0 else 1.0,
                                    seed=seed, logit_bias={PAD: 6.0}, skip_special_tokens=False)
            outs = [o async for o in engine.generate("hello", params=params)]
            return "".join(o.text for o in outs), outs[-1].finish_reason

        total = 0
        for text, reason in await asyncio.gather(*[one(seed) for seed in range(6)]):
            done, free = _structures(text, begins, "} .")
            assert reason == "length" or free, (reason, text)  # EOS only in free text
            total += done
        assert total >= 6
        engine.check_accounting()
    finally:
        await engine.stop()


async def test_engine_grammar_after(tiny_models):
    """Before the marker (<pad>) the text is free; from it on, the schema; the output ends
    when the document does."""
    engine = Engine(model=str(tiny_models["llama"]), kv_cache_tokens=20000, grammar_compile_memory_mb=0)
    try:
        async def one(seed: int) -> tuple[str, str]:
            params = SamplingParams(json_schema=ARGS, grammar_after="<pad>", max_new_tokens=80, temperature=1.0,
                                    seed=seed, logit_bias={PAD: 3.0}, skip_special_tokens=False)
            outs = [o async for o in engine.generate("hello", params=params)]
            return "".join(o.text for o in outs), outs[-1].finish_reason

        free_before = 0
        for text, reason in await asyncio.gather(*[one(seed) for seed in range(6)]):
            if "<pad>" not in text:
                continue
            before, after = text.split("<pad>", 1)
            free_before += bool(before.strip()) and not before.lstrip().startswith("{")
            assert reason == "stop", text
            jsonschema.validate(json.loads(after), ARGS)
        assert free_before >= 2
        # without the marker in the output: unconstrained (stops anywhere, EOS included)
        params = SamplingParams(json_schema=ARGS, grammar_after="NEVER", max_new_tokens=8, temperature=1.0, seed=1)
        text = "".join([o.text async for o in engine.generate("hello", params=params)])
        free = "".join([o.text async for o in engine.generate("hello", params=SamplingParams(
            max_new_tokens=8, temperature=1.0, seed=1))])
        assert text == free
        engine.check_accounting()
    finally:
        await engine.stop()
