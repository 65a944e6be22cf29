"""Built-in reasoning parsers, registered through ``radixd_reasoning_parsers`` like any plugin.

A reasoning parser describes one model family's thinking markup; it holds no state and
splits nothing itself (``radixd.server.reasoning.ReasoningSplitter`` does, from the markers
given here). What a parser class provides (the hook's contract):

- ``start`` / ``end``: the markers around the reasoning (``<think>`` / ``</think>``);
- ``implicit_ends``: markers that also end the reasoning and stay in the content (Qwen3.5
  may open ``<tool_call>`` without closing ``</think>`` first);
- ``thinks(template_kwargs) -> bool``: whether the output of a request rendered with these
  ``chat_template_kwargs`` starts inside the reasoning, asked only when the template writes
  neither marker in the assistant's turn (one that opens or closes a block there decides);
  a leading ``start`` in the output is dropped either way, and an output that does not think
  may still open with ``start``;
- ``detect(chat_template, generation_prompt) -> bool`` (a classmethod): whether
  ``reasoning_parser = "auto"`` should pick it for a model whose chat template is this text
  and writes ``generation_prompt`` for the assistant's turn.
"""

from __future__ import annotations

from typing import Any

from radixd.plugins import hookimpl


class ThinkTags:
    """``<think>...</think>`` markup; the model always thinks."""

    start = "<think>"
    end = "</think>"
    implicit_ends: tuple[str, ...] = ()

    def thinks(self, template_kwargs: dict[str, Any]) -> bool:
        return True

    @classmethod
    def detect(cls, chat_template: str, generation_prompt: str) -> bool:
        return False


class Qwen3(ThinkTags):
    """Qwen3 / Qwen3.5: thinking unless ``chat_template_kwargs.enable_thinking`` is false (the
    template then pre-fills an empty think block and the output is all content). The older
    templates let the model write ``<think>`` itself, the newer ones put it in the prompt:
    both read the same, as SGLang's and vLLM's qwen3 parsers do (a missing ``</think>``:
    the output was cut while thinking, all of it is reasoning)."""

    implicit_ends = ("<tool_call>",)

    def thinks(self, template_kwargs: dict[str, Any]) -> bool:
        return template_kwargs.get("enable_thinking", True) is not False

    @classmethod
    def detect(cls, chat_template: str, generation_prompt: str) -> bool:
        return "enable_thinking" in chat_template and cls.end in chat_template


class Qwen3Thinking(ThinkTags):
    """Qwen3's thinking-only releases (``-Thinking-2507``): no switch, the prompt opens the block
    (SGLang's name; "auto" picks ``deepseek-r1`` for them, which reads them alike)."""


class DeepSeekR1(ThinkTags):
    """DeepSeek-R1 style: the template opens ``<think>`` in the prompt, so the output starts
    inside the reasoning and holds only ``</think>`` (a repeated ``<think>``: dropped). "auto"
    picks it for templates whose assistant turn ends inside an open block (R1-0528, Qwen3's
    thinking releases); not for those that merely strip old reasoning from the history."""

    @classmethod
    def detect(cls, chat_template: str, generation_prompt: str) -> bool:
        return "enable_thinking" not in chat_template and generation_prompt.rstrip().endswith(cls.start)


@hookimpl
def radixd_reasoning_parsers():
    return {"qwen3": Qwen3, "qwen3-thinking": Qwen3Thinking, "deepseek-r1": DeepSeekR1}
