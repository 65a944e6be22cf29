"""Chat messages to prompt token ids: the model's template (with the request's template
options and tools; a history's tool calls and results shaped by ``tool_calls``), with
special-token text in message contents handled per ``limits.chat_special_tokens``."""

from __future__ import annotations

import uuid
from typing import Any

from radixd.server.errors import ApiError
from radixd.server.state import ServerState


def chat_prompt_ids(st: ServerState, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    """The chat template applied to ``messages``, with text in their contents that spells a
    special token (``<|im_start|>``, ``<eos>``, ...) handled per ``limits.chat_special_tokens``:
    such text would otherwise become the control token itself, letting a message open a new
    turn under another role. "refuse": 400; "as_text": tokenized as plain text; "allow": as is.
    ``continue_final_message`` leaves the last message open (the model continues it);
    ``template_kwargs`` are handed to the template (vLLM's ``chat_template_kwargs``), and so
    are ``tools`` (OpenAI's tool objects; ``tool_calls.prompt`` says when)."""
    how = st.settings.limits.chat_special_tokens
    tok = st.engine.tokenizer
    messages = st.tools.history(messages)  # a history's tool calls and results as the template takes them
    found = None if how == "allow" else _special_text(tok, messages)
    kw = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        kw["continue_final_message"] = True
    if tools:
        kw["tools"] = tools
    try:
        if found is None:
            return st.engine.apply_chat_template(messages, **kw)
        i, key, text = found
        if how == "refuse" or key != "content":  # as text: only contents are tokenized apart
            raise ApiError(400, f"'messages[{i}].{key}' contains the special token text {text!r}; this server "
                                f"refuses it (limits.chat_special_tokens = \"{how}\")", param="messages",
                           code="special_token_in_content")
        return _template_contents_as_text(tok, messages, kw)
    except ApiError:
        raise
    except Exception as exc:  # templates raise on e.g. a bad role order
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc


def _special_text(tok, messages: list[dict]) -> tuple[int, str, str] | None:
    """(message index, its field, the special token's text) of the first message text that
    spells a special token, if one does."""
    specials = [t for t in tok.all_special_tokens if t]
    specials += [a.content for a in tok.added_tokens_decoder.values() if a.special and a.content not in specials]
    for i, m in enumerate(messages):
        for key in ("content", "reasoning_content"):
            for text in specials:
                if text in (m.get(key) or ""):
                    return i, key, text
    return None


def _template_contents_as_text(tok, messages: list[dict], kw: dict[str, Any]) -> list[int]:
    """Render the template around placeholders, then tokenize the template's own text with
    its special tokens and each message content with special-token text split into plain
    tokens: no content can produce a control token."""
    nonce = uuid.uuid4().hex
    marks = [f"\u241f{nonce}{i}\u241f" for i in range(len(messages))]
    rendered = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)],
                                       tokenize=False, **kw)
    ids: list[int] = []
    for i, mark in enumerate(marks):
        head, sep, rendered = rendered.partition(mark)
        if not sep:
            raise ValueError(f"the template does not show messages[{i}].content as given")
        ids += tok(head, add_special_tokens=False).input_ids
        ids += tok(messages[i]["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids + tok(rendered, add_special_tokens=False).input_ids

