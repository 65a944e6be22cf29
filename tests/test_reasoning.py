"""Reasoning output apart from the answer: the splitter and the built-in parsers (recorded
output shapes of Qwen3 and DeepSeek-R1, whole and streamed split at every character), the
parser choice from ``[model] reasoning_parser`` and the chat template, and the request's
reasoning fields."""

from __future__ import annotations

import pytest

from radixd.core.errors import ConfigError
from radixd.core.sampling_params import SamplingParams
from radixd.plugins import hookimpl, make_plugin_manager
from radixd.plugins.reasoning import DeepSeekR1, Qwen3, Qwen3Thinking
from radixd.server import reasoning
from radixd.server.errors import ApiError
from radixd.server.reasoning import ChatReasoning, ReasoningSplitter

OFF = {"enable_thinking": False}

# (parser, chat_template_kwargs, model output, reasoning, content)
CASES = [
    # Qwen3 (older templates: the model writes <think> itself)
    (Qwen3, {}, "<think>\nLet me add.\n</think>\n\nThe answer is 4.", "\nLet me add.\n", "\n\nThe answer is 4."),
    # Qwen3.5 (the template opens <think> in the prompt)
    (Qwen3, {}, "Let me add.</think>4", "Let me add.", "4"),
    # reasoning only: cut by max_tokens before </think>
    (Qwen3, {}, "<think>\nLet me add 2 and", "\nLet me add 2 and", ""),
    (Qwen3, {}, "<think>\nLet me add</thi", "\nLet me add</thi", ""),  # cut inside the marker
    (Qwen3, {}, "<thi", "<thi", ""),
    # an empty think block, then the answer
    (Qwen3, {}, "<think>\n\n</think>\n\nHi.", "\n\n", "\n\nHi."),
    # Qwen3.5 opens a tool call without closing </think>: the call stays in the content
    (Qwen3, {}, "I should call it.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
     "I should call it.\n", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>"),
    # thinking off: the template pre-filled an empty block, all output is content
    (Qwen3, OFF, "The answer is 4.", "", "The answer is 4."),
    (Qwen3, OFF, "4 </think> 5", "", "4 </think> 5"),
    (Qwen3, OFF, "", "", ""),
    (Qwen3, OFF, "<th", "", "<th"),
    (Qwen3, OFF, "<think>x</think>y", "x", "y"),  # a block the model opens itself still splits
    # a second block is content (one reasoning block per turn)
    (Qwen3, {}, "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    # plain text, no think block at all: Qwen3 with thinking on counts it as reasoning cut short
    (Qwen3, {}, "Hello there.", "Hello there.", ""),
    # DeepSeek-R1: only </think> in the output
    (DeepSeekR1, {}, "Okay, 2+2.\n</think>\n\n4", "Okay, 2+2.\n", "\n\n4"),
    (DeepSeekR1, {}, "<think>\nOkay.</think>4", "\nOkay.", "4"),  # R1-0528 repeats <think>
    (DeepSeekR1, {}, "Okay, still thinking", "Okay, still thinking", ""),
    (DeepSeekR1, OFF, "Okay.</think>4", "Okay.", "4"),  # R1 has no switch
    (DeepSeekR1, {}, "a<tool_call>b</think>c", "a<tool_call>b", "c"),  # no implicit end for R1
    (DeepSeekR1, {}, "</think>", "", ""),
    (Qwen3Thinking, OFF, "x</think>y", "x", "y"),
    # markers' look-alikes are text
    (DeepSeekR1, {}, "a </thinking> b </thin", "a </thinking> b </thin", ""),
    (Qwen3, {}, "<thought>x", "<thought>x", ""),
]


def splitter(parser, kwargs, **kw) -> ReasoningSplitter:
    p = parser()
    return ReasoningSplitter(p.start, p.end, p.implicit_ends, inside=p.thinks(kwargs), **kw)


@pytest.mark.parametrize("parser, kwargs, text, want_reasoning, want_content", CASES)
def test_split(parser, kwargs, text, want_reasoning, want_content):
    assert splitter(parser, kwargs).split(text) == (want_reasoning, want_content)


@pytest.mark.parametrize("parser, kwargs, text, want_reasoning, want_content", CASES)
def test_streamed_split_at_every_character(parser, kwargs, text, want_reasoning, want_content):
    for cut in range(len(text) + 1):  # two deltas, cut at each place
        s = splitter(parser, kwargs)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (want_reasoning, want_content), cut
    s = splitter(parser, kwargs)  # one character a delta
    parts = [s.feed(ch) for ch in text] + [s.flush()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (want_reasoning, want_content)
    # nothing shown on the wrong side: reasoning deltas never follow content
    assert all(not r for i, (r, _) in enumerate(parts) if any(c for _, c in parts[:i]))


def test_held_back_only_while_it_may_be_a_marker():
    s = splitter(Qwen3, {})
    assert s.feed("<think>abc</") == ("abc", "")  # "</" may start </think>
    assert s.feed("b>") == ("</b>", "")
    assert s.feed("de</think") == ("de", "")
    assert s.feed(">x") == ("", "x")
    assert s.feed("</think>") == ("", "</think>")  # content is never held
    s = splitter(Qwen3, OFF)
    assert s.feed("<") == ("", "")  # may still open a block
    assert s.feed("b") == ("", "<b")


def test_stream_reasoning_false_gives_the_reasoning_in_one_delta():
    s = splitter(Qwen3, {}, stream_reasoning=False)
    assert s.feed("<think>a") == ("", "")
    assert s.feed("bc</th") == ("", "")
    assert s.feed("ink>d") == ("abc", "d")
    s = splitter(Qwen3, {}, stream_reasoning=False)
    assert s.feed("abc") == ("", "") and s.flush() == ("abc", "")  # cut while thinking: at the end


def test_resume_after_a_continued_message():
    s = splitter(Qwen3, {})
    s.resume("<think>I was thinking")
    assert s.in_reasoning and s.split("more</think>done") == ("more", "done")
    s = splitter(Qwen3, {})
    s.resume("<think>x</think>Partial ans")
    assert not s.in_reasoning and s.split("wer") == ("", "wer")
    s = splitter(DeepSeekR1, {})
    s.resume("abc</thi")  # what the prompt held back is not output
    assert s.split("nk>") == ("nk>", "")


# ------------------------------------------------------------------------ choosing the parser

QWEN3_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                  "<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                  "{% endif %}{% endif %}")
_HISTORY = ("{% for m in messages %}{% set c = m.content %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
            "{% endif %}<{{ m.role }}>{{ c }}{% endfor %}")
R1_TEMPLATE = _HISTORY + "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
INSTRUCT_TEMPLATE = _HISTORY + "{% if add_generation_prompt %}<assistant>{% endif %}"  # strips, never thinks
V31_TEMPLATE = _HISTORY + "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"


def tokenizer(template: str | None):
    from conftest import _tokenizer

    tok = _tokenizer()
    tok.chat_template = template
    return tok


def test_builtin_parsers_and_auto():
    table = reasoning.available(make_plugin_manager(load_entry_points=False))
    assert {"qwen3", "qwen3-thinking", "deepseek-r1"} <= set(table)
    assert isinstance(reasoning.choose("auto", table, tokenizer(QWEN3_TEMPLATE)), Qwen3)
    assert isinstance(reasoning.choose("auto", table, tokenizer(R1_TEMPLATE)), DeepSeekR1)
    for other in (INSTRUCT_TEMPLATE, V31_TEMPLATE, "{{ messages }}", None):  # no open block: no parser
        assert reasoning.choose("auto", table, tokenizer(other)) is None, other
    assert reasoning.choose("none", table, tokenizer(QWEN3_TEMPLATE)) is None
    assert isinstance(reasoning.choose("deepseek-r1", table, tokenizer(QWEN3_TEMPLATE)), DeepSeekR1)
    with pytest.raises(ConfigError, match="auto, none or one of deepseek-r1, qwen3, qwen3-thinking"):
        reasoning.choose("qwen", table, tokenizer(QWEN3_TEMPLATE))


@pytest.mark.parametrize("template, parser, kwargs, inside", [
    (QWEN3_TEMPLATE, Qwen3, {}, True),             # the model writes <think> itself
    (QWEN3_TEMPLATE, Qwen3, OFF, False),           # the template closed an empty block
    (R1_TEMPLATE, DeepSeekR1, {}, True),           # the template opened it
    (V31_TEMPLATE, DeepSeekR1, {}, False),         # closed: no thinking this time
    (V31_TEMPLATE, DeepSeekR1, {"thinking": True}, True),
    (INSTRUCT_TEMPLATE, DeepSeekR1, {}, True),     # no marker: the parser's rule (R1 always thinks)
    ("{{ raise_exception('no') }}", Qwen3, OFF, False),  # no rendering: the parser's rule
])
def test_where_the_output_starts(template, parser, kwargs, inside):
    opening = reasoning.generation_prompt(tokenizer(template), kwargs)
    assert reasoning.starts_inside(parser(), opening, kwargs) is inside


class _Twice:
    start, end, implicit_ends = "<t>", "</t>", ()

    def thinks(self, kwargs):
        return True

    @classmethod
    def detect(cls, template, generation_prompt):
        return generation_prompt.endswith("<think>\n")


class Parsers:
    def __init__(self, name: str):
        self.name = name

    @hookimpl
    def radixd_reasoning_parsers(self):
        return {self.name: _Twice}


def test_a_name_two_plugins_give_is_refused():
    pm = make_plugin_manager(load_entry_points=False, extra=[Parsers("qwen3")])
    with pytest.raises(ValueError, match="two plugins provide a reasoning parser named 'qwen3'"):
        reasoning.available(pm)


def test_auto_refuses_a_template_that_several_parsers_fit():
    table = reasoning.available(make_plugin_manager(load_entry_points=False, extra=[Parsers("tees")]))
    assert isinstance(reasoning.choose("tees", table, tokenizer(R1_TEMPLATE)), _Twice)
    with pytest.raises(ConfigError, match="deepseek-r1, tees"):
        reasoning.choose("auto", table, tokenizer(R1_TEMPLATE))


# ------------------------------------------------------------------------ a request's handling


def test_request_fields():
    q = Qwen3()
    plain = ChatReasoning.of(q, {}, {})
    assert plain.message("<think>r</think>c") == {"content": "c", "reasoning_content": "r", "reasoning": "r"}
    assert plain.message("<think>r") == {"content": None, "reasoning_content": "r", "reasoning": "r"}
    assert plain.message("") == {"content": "", "reasoning_content": None, "reasoning": None}
    raw = ChatReasoning.of(q, {"separate_reasoning": False}, {})
    assert raw.message("<think>r</think>c") == {"content": "<think>r</think>c"}
    dropped = ChatReasoning.of(q, {"include_reasoning": False}, {})
    assert dropped.message("<think>r</think>c") == {"content": "c"}
    nulls = ChatReasoning.of(q, dict.fromkeys(reasoning.FIELDS), {})
    assert nulls.message("r</think>c")["reasoning_content"] == "r"
    assert ChatReasoning.of(None, {}, {}).message("<think>r</think>c") == {"content": "<think>r</think>c"}
    for key in reasoning.FIELDS:
        with pytest.raises(ApiError, match=key):
            ChatReasoning.of(None, {key: "yes"}, {})
    # streamed: per choice, the held-back text at the end
    s = ChatReasoning.of(q, {}, {})
    assert s.delta(0, "<think>a</th", False) == {"reasoning_content": "a", "reasoning": "a"}
    assert s.delta(1, "b", False) == {"reasoning_content": "b", "reasoning": "b"}
    assert s.delta(0, "ink>c", False) == {"content": "c"}
    assert s.delta(1, "</thi", True) == {"reasoning_content": "</thi", "reasoning": "</thi"}


def test_reasoning_end_and_grammar_after():
    q = Qwen3()
    assert ChatReasoning.of(q, {}, {}).reasoning_end() == "</think>"
    assert ChatReasoning.of(q, {}, OFF).reasoning_end() is None  # thinking off: grammars from the start
    assert ChatReasoning.of(q, {"separate_reasoning": False}, {}).reasoning_end() is None
    assert ChatReasoning.of(None, {}, {}).reasoning_end() is None
    assert ChatReasoning.of(q, {}, {}, previous="<think>a</think>b").reasoning_end() is None  # closed before
    assert ChatReasoning.of(DeepSeekR1(), {}, OFF).reasoning_end() == "</think>"
    free = SamplingParams(max_new_tokens=4)
    assert ChatReasoning.of(q, {}, {}).constrain(free) is free  # no grammar, nothing to defer
    schema = SamplingParams(max_new_tokens=4, json_schema={"type": "object"})
    assert ChatReasoning.of(q, {}, {}).constrain(schema).grammar_after == "</think>"
    assert ChatReasoning.of(q, {}, OFF).constrain(schema).grammar_after is None


# ------------------------------------------------------------------------ the command line


def test_check_config_and_the_launch_flag(tmp_path, capsys):
    from radixd.cli import main

    assert main(["check-config", "--reasoning-parser", "deepseek-r1"]) == 0
    assert 'reasoning_parser = "deepseek-r1"  # --reasoning-parser' in capsys.readouterr().out
    assert main(["check-config", "--reasoning-parser", "qwen"]) == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser (model.reasoning_parser)" in err and "auto, none or one of deepseek-r1, qwen3" in err
    cfg = tmp_path / "r.toml"
    cfg.write_text('[model]\nreasoning_parser = "r1"\n')
    assert main(["check-config", str(cfg)]) == 2
    assert "model.reasoning_parser" in capsys.readouterr().err
    assert main(["plugins", "--provides"]) == 0
    assert "reasoning parsers: deepseek-r1, qwen3, qwen3-thinking" in capsys.readouterr().out


def test_history_reasoning_is_kept_for_the_template():
    """An assistant turn's ``reasoning_content`` (vLLM: ``reasoning``) reaches the chat
    template (Qwen3's renders it in tool loops); elsewhere, or not a string: a 400."""
    from radixd.server.protocol import chat_messages

    turn = {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}
    got = chat_messages({"messages": [{"role": "user", "content": "2 + 2?"}, turn]})
    assert got[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}
    vllm = chat_messages({"messages": [{"role": "assistant", "content": "4", "reasoning": "sum"}]})
    assert vllm[0]["reasoning_content"] == "sum"
    for bad in ({"role": "user", "content": "x", "reasoning_content": "y"},
                {"role": "assistant", "content": "x", "reasoning_content": 3}):
        with pytest.raises(ApiError) as exc:
            chat_messages({"messages": [bad]})
        assert "reasoning_content" in exc.value.message
