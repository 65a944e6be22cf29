"""Tool-call parsers: recorded model outputs of each format -> the exact OpenAI objects, the
same whole and streamed (split at every character, and fed one character at a time), with
markup never in ``content``; malformed markup comes back as content text. Also the parser
picked from a chat template and ``model.tool_parser`` checked by ``check-config``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from radixd.cli import main
from radixd.plugins import make_plugin_manager
from radixd.server.tool_calls import ToolSupport, parser_table
from radixd.server.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from radixd.server.tool_parsing import JsonPrefix, merge

NAMES = ["get_weather", "add"]


def call(i: int, name: str, arguments: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


W = '{"city": "Paris", "unit": "c"}'
A = '{"a": 1, "b": [2, 3.5e1, -0.25, true, null, {"x": "}\\"]"}]}'
CASES = {
    HermesParser: [
        ("The weather is fine.\n", "The weather is fine.\n", []),
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [call(0, "get_weather", W)]),
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
         f'{{"name": "add", "arguments": {A}}}\n</tool_call>', None,
         [call(0, "get_weather", W), call(1, "add", A)]),
        (f'Let me look that up.\n\n<tool_call>{{"name": "add", "arguments": {A}}}</tool_call>', "Let me look that up.",
         [call(0, "add", A)]),
        ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', None, [call(0, "add", '{"a": 1}')]),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [call(0, "add", '{"a": 1}')]),
        # malformed: all content, nothing lost
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}'
         '</tool_call>', []),
        ('a < b and <tool_ <tool_call>{"name": }', 'a < b and <tool_ <tool_call>{"name": }', []),
        ('<tool_call>{"name": "add"}</tool_call>', '<tool_call>{"name": "add"}</tool_call>', []),
        # a committed call cut off (max_tokens): the call with what was generated
        ('<tool_call>{"name": "add", "arguments": {"a": 1', None, [call(0, "add", '{"a": 1')]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call> then', "then", [call(0, "add", '{"a": 1')]),
    ],
    Llama3JsonParser: [
        ("  Paris is sunny {today}.", "  Paris is sunny {today}.", []),
        (f'{{"name": "get_weather", "parameters": {W}}}', None, [call(0, "get_weather", W)]),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', None, [call(0, "get_weather", W)]),
        (f'{{"name": "get_weather", "parameters": {W}}}; {{"name": "add", "parameters": {A}}}', None,
         [call(0, "get_weather", W), call(1, "add", A)]),
        (f'Checking. <|python_tag|>{{"name": "add", "arguments": {A}}}', "Checking.", [call(0, "add", A)]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "add", "parameters": {"a": 1}} and more', "and more", [call(0, "add", '{"a": 1}')]),
    ],
    MistralParser: [
        ("No tools needed.", "No tools needed.", []),
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', None, [call(0, "get_weather", W)]),
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "add", "arguments": {A}}}]', None,
         [call(0, "get_weather", W), call(1, "add", A)]),
        (f"[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{A}", None,
         [call(0, "get_weather", W), call(1, "add", A)]),
        (f"Sure.[TOOL_CALLS]add[ARGS]{A}", "Sure.", [call(0, "add", A)]),
        ("[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
        ("[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
    ],
}
ALL = [(p, text, content, calls) for p, cases in CASES.items() for text, content, calls in cases]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(parser, pieces: list[str]) -> list[dict]:
    s = parser.stream(NAMES, new_id=ids())
    out = []
    for piece in pieces:
        out += s.feed(piece)
    return out + s.flush()


def check_deltas(deltas: list[dict]) -> None:
    """OpenAI's delta shapes: a call opens with index, id, type, name and empty arguments,
    then only argument fragments of that index; indexes count up from 0."""
    opened = -1
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            continue
        (c,) = d["tool_calls"]
        if "id" in c:
            assert c["index"] == opened + 1 and c["type"] == "function" and c["function"]["arguments"] == ""
            assert c["id"].startswith("call_") and c["function"]["name"] in NAMES
            opened = c["index"]
        else:
            assert set(c) == {"index", "function"} and c["index"] == opened and set(c["function"]) == {"arguments"}
            assert c["function"]["arguments"]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), ALL,
                         ids=[f"{p.name}-{i}" for i, (p, *_) in enumerate(ALL)])
def test_recorded_output_parses_to_openai_objects(cls, text, content, calls):
    parser = cls("[ARGS]" if cls is MistralParser else "")
    assert parser.parse(text, NAMES, new_id=ids()) == (content, calls)
    one_by_one = streamed(parser, list(text))
    check_deltas(one_by_one)
    assert merge(one_by_one) == (content, calls)
    for cut in range(len(text) + 1):
        assert merge(streamed(parser, [text[:cut], text[cut:]])) == (content, calls), cut


def test_streamed_call_opens_before_its_arguments_end():
    s = HermesParser().stream(NAMES, new_id=ids())
    assert s.feed("<tool_") == []  # may be markup: held back
    assert s.feed('call>{"name": "add", "arguments": {"a"') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}]
    assert s.feed(": 1}}</tool_call>") == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert s.flush() == []


def test_json_prefix_follows_json():
    for text in ('{"a": [1, -2.5e+3, "x\\u00e9\\n", true, false, null, {}], "b": {"c": []}}', "[]", '{"k": 0}'):
        p = JsonPrefix()
        assert all(p.push(c) for c in text) and p.done
    for bad in ('{"a" 1}', '{"a": tru}', '{"a": 1,}', '{"a": "\x01"}', '{"a": [}', '{a: 1}', '{"a": 1.}', '{"a": -}'):
        p = JsonPrefix()
        assert not all(p.push(c) for c in bad) or not p.done, bad


class _Tok:
    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False, tools=None, **kw):
        from jinja2 import Template

        return Template(self.chat_template).render(messages=messages, tools=tools, **kw)


QWEN_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools> Reply with "
             "<tool_call>{}</tool_call>{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
             "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}"
             "</tool_call>{% endfor %}{% endfor %}")


@pytest.mark.parametrize(("template", "name", "tools", "calls"), [
    (QWEN_LIKE, "hermes", True, True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}<|python_tag|>", "llama3_json", False, False),
    ("{% for m in messages %}[INST]{{ m.content }}{% endfor %}[TOOL_CALLS]", "mistral", False, False),
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}", "hermes", False, False),
])
def test_parser_picked_from_the_template(template, name, tools, calls):
    pm = make_plugin_manager(load_entry_points=False)
    support = ToolSupport.load(pm, "auto", _Tok(template))
    assert (support.parser.name, support.renders_tools, support.renders_calls) == (name, tools, calls)
    assert ToolSupport.load(pm, "mistral", _Tok(template)).parser.name == "mistral"
    assert ToolSupport.load(pm, "none", _Tok(template)).parser is None
    assert set(parser_table(pm)) == {"hermes", "llama3_json", "mistral"}


def test_check_config_refuses_an_unknown_tool_parser(tmp_path: Path, capsys):
    cfg = tmp_path / "radixd.toml"
    cfg.write_text('[model]\ntool_parser = "qwen9"\n')
    assert main(["check-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "'model.tool_parser': got 'qwen9'; allowed: auto, none, hermes, llama3_json, mistral" in err
    cfg.write_text('[model]\ntool_parser = "mistral"\n')
    assert main(["check-config", str(cfg)]) == 0
    assert 'tool_parser = "mistral"' in capsys.readouterr().out
