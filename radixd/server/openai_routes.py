"""The OpenAI API's generation routes: ``/v1/chat/completions`` and ``/v1/completions``.

Bodies are parsed by ``protocol``; submission, collection and streaming by ``Generation``;
this module shapes OpenAI's response objects, stream chunks and logprobs (with vLLM's
extras: prompt logprobs, usage in every chunk, prompts cut to their last tokens); chat
output passes ``reasoning`` first (the thinking apart from the content), then ``tool_calls``
(the calls in the content; the tools and their grammar are its too).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd import __version__
from radixd.core.outputs import GenerateOutput
from radixd.server import protocol, reasoning, tool_calls
from radixd.server.chat import chat_prompt_ids
from radixd.server.generation import Generation, samples
from radixd.server.sse import Framing
from radixd.server.state import state_of


async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    body = await protocol.read_json(request)
    req = protocol.parse_chat(body, st.limits, st.model_name)
    call = await start_chat(st, request, req, body)
    if not req.parsed.stream:
        return JSONResponse(await call.result())
    return call.gen.stream(lambda: call.chunks(chunks(call.gen, req.parsed.continuous_usage)))


class ChatCall(NamedTuple):
    """A started chat completion: await ``result()`` for the ``chat.completion`` object, or
    iterate ``chunks(event)`` for its ``chat.completion.chunk`` objects, each passed through
    ``event`` (the route's SSE framing; by default none); one of the two, once. Other routes
    (``/v1/responses``) reshape these."""

    gen: Generation
    result: Callable[[], Awaitable[dict]]
    chunks: Callable[..., AsyncIterator[dict]]


async def start_chat(st, request: Request, req: protocol.ChatRequest, body: dict) -> ChatCall:
    """The chat route's internals for a parsed ``body``: the prompt rendered and submitted."""
    think = reasoning.for_chat(st, body, req)
    parsed, ex = req.parsed, req.parsed.extras
    treq = tool_calls.read_request(body, st.tools)
    messages, tools = tool_calls.prompt(st.tools, treq, req.messages)
    # the tools' grammar, and any other, starts after the reasoning
    params = think.constrain(tool_calls.constrain(st.tools, treq, parsed.params, after=think.reasoning_end()))
    ids = truncated(st, chat_prompt_ids(st, messages, add_generation_prompt=ex.add_generation_prompt,
                                        continue_final_message=ex.continue_final_message,
                                        template_kwargs=ex.template_kwargs, tools=tools), parsed)
    gen = await Generation.start(st, request, [ids], [params], priority=parsed.priority, shown=req.messages)
    calls = tool_calls.ToolOutputs(st.tools, treq, params.n)
    cid = f"chatcmpl-{gen.rid}"
    created = int(time.time())
    tok = st.engine.tokenizer

    async def result() -> dict:
        outs = (await gen.collect())[0]
        extra = {"prompt_logprobs": prompt_logprobs(tok, ids, outs, ex.prompt_logprobs)} if ex.prompt_logprobs is not None else {}
        choices = [{
            "index": i,
            "message": reply_message(think, calls, i, "".join(o.text for o in mine), ex.echo),
            "logprobs": chat_logprobs(tok, mine) if params.logprobs else None,
            "finish_reason": calls.finish_reason(i, mine[-1].finish_reason),
            "stop_reason": stop_reason(mine[-1], params),
        } for i, mine in enumerate(samples(outs, params.n))]
        return {
            "id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": gen.usage(), "system_fingerprint": f"radixd-{__version__}", **extra,
        }

    async def events(event: Framing | Unframed = UNFRAMED):
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": f"radixd-{__version__}"}

        def content_chunk(index: int, text: str) -> dict:  # the common chunk: only its content changes
            return {**base, "choices": [{"index": index, "delta": {"content": text}, "logprobs": None,
                                         "finish_reason": None}]}
        for i in range(params.n):
            yield event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
            if ex.echo:
                yield event({**base, "choices": [{"index": i, "delta": {"content": ex.echo}, "logprobs": None,
                                                "finish_reason": None}]})
        async for _, out in gen.outputs():
            lp = chat_logprobs(tok, [out]) if params.logprobs and out.token_ids else None
            thought, text = think.feed(out.index, out.text, out.finished)
            deltas = calls.deltas(out.index, text, out.finished)
            if thought and (head := think.fields(thought)):
                deltas = [head, *deltas]
            deltas = deltas or ([{}] if lp or out.finished else [])
            for k, delta in enumerate(deltas):
                end = out.finished and k == len(deltas) - 1
                if not end and (lp is None or k > 0) and len(delta) == 1 and type(delta.get("content")) is str:
                    yield event.text(content_chunk, out.index, delta["content"])
                    continue
                yield event({**base, "choices": [{
                    "index": out.index, "delta": delta, "logprobs": lp if k == 0 else None,
                    "finish_reason": calls.finish_reason(out.index, out.finish_reason) if end else None,
                    **({"stop_reason": stop_reason(out, params)} if end else {})}]})
        if parsed.include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})

    return ChatCall(gen, result, events)


def reply_message(think: reasoning.ChatReasoning, calls: tool_calls.ToolOutputs, index: int, text: str,
                  echo: str) -> dict:
    """Choice ``index``'s assistant message from its whole text: the reasoning apart, the
    calls read from the rest; ``echo`` (vLLM's chat echo: the assistant prefill) leads the
    content, which is null when there is only reasoning or only calls."""
    thought, rest = think.split(text)
    message = calls.message(index, rest)
    if echo:
        message["content"] = echo + (message["content"] or "")
    if thought and not message["content"]:
        message["content"] = None
    return {**message, **think.fields(thought)}


async def completions(request: Request) -> Response:
    st = state_of(request)
    req = protocol.parse_completion(await protocol.read_json(request), st.limits, st.model_name)
    parsed, params, prompts = req.parsed, req.parsed.params, req.prompts
    tok = st.engine.tokenizer
    with_prompt_lp = params.prompt_logprobs_from is not None
    if with_prompt_lp or parsed.extras.truncate_prompt_tokens is not None:  # ids needed here
        prompts = [truncated(st, tok(p).input_ids if isinstance(p, str) else p, parsed) for p in prompts]
    gen = await Generation.start(st, request, prompts, [params] * len(prompts), priority=parsed.priority)
    n = params.n
    cid = f"cmpl-{gen.rid}"
    created = int(time.time())
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts]
    echo_lp = req.echo and params.logprobs  # the echoed prompt's tokens lead the logprobs

    def echoed(pi: int, outs: list[GenerateOutput]) -> tuple[str, dict | None]:
        """The choice's echoed prompt text and, with logprobs, its tokens' logprobs."""
        return echoes[pi], (prompt_token_logprobs(tok, prompts[pi], outs, params.top_logprobs) if echo_lp else None)

    if not parsed.stream:
        results = await gen.collect()
        choices = [{
            "index": pi * n + i, "text": echoes[pi] + "".join(o.text for o in mine),
            "logprobs": (completion_logprobs(tok, mine, len(echoes[pi]), echoed(pi, mine)[1])
                         if params.logprobs else None),
            "finish_reason": mine[-1].finish_reason,
            "stop_reason": stop_reason(mine[-1], params),
            **({"prompt_logprobs": prompt_logprobs(tok, prompts[pi], mine, parsed.extras.prompt_logprobs)}
               if parsed.extras.prompt_logprobs is not None else {}),
        } for pi, outs in enumerate(results) for i, mine in enumerate(samples(outs, n))]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
                             "choices": choices, "usage": gen.usage()})

    async def events():
        base = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name}
        event = chunks(gen, parsed.continuous_usage)

        def text_chunk(index: int, text: str) -> dict:  # the common chunk: only its text changes
            return {**base, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}]}
        offsets: dict[int, int] = {}
        if req.echo and not echo_lp:
            for pi in range(len(prompts)):
                for i in range(n):
                    yield event({**base, "choices": [{"index": pi * n + i, "text": echoes[pi], "logprobs": None,
                                                    "finish_reason": None}]})
        async for pi, out in gen.outputs():
            idx = pi * n + out.index
            if echo_lp and idx not in offsets:  # the first update carries the prompt's logprobs
                text, lp = echoed(pi, [out])
                offsets[idx] = len(text)
                yield event({**base, "choices": [{"index": idx, "text": text, "logprobs": lp, "finish_reason": None}]})
            lp = None
            if params.logprobs:
                lp = completion_logprobs(tok, [out], offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(out.text)
            if not (out.text or out.token_ids or out.finished):
                continue
            if lp is None and not out.finished:
                yield event.text(text_chunk, idx, out.text)
            else:
                yield event({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                "finish_reason": out.finish_reason if out.finished else None,
                                                **({"stop_reason": stop_reason(out, params)} if out.finished else {})}]})
        if parsed.include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})

    return gen.stream(events)


def stop_reason(out: GenerateOutput, params) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` entry that ended the
    choice; None when it ended otherwise (EOS, a completed grammar, the length)."""
    m = out.matched if out.finish_reason == "stop" else None
    return m if isinstance(m, str) or m in params.stop_token_ids else None


def chunks(gen: Generation, continuous_usage: bool) -> Framing:
    """The stream's event framing: with ``continuous_usage`` every chunk carries the usage so far."""
    return Framing((lambda: {"usage": gen.usage()}) if continuous_usage else None)


class Unframed:
    """``ChatCall.chunks``' default ``event``: the chunk objects themselves, unframed."""

    def __call__(self, chunk: dict) -> dict:
        return chunk

    def text(self, build: Callable[[int, str], dict], key: int, text: str) -> dict:
        return build(key, text)


UNFRAMED = Unframed()


def truncated(st, ids: list[int], parsed: protocol.ParsedRequest) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (-1: as many as fit
    beside ``max_tokens`` in the context)."""
    keep = parsed.extras.truncate_prompt_tokens
    if keep == -1:
        keep = max(1, st.engine.context_len - parsed.params.max_new_tokens)
    return ids if keep is None else ids[-keep:]


def _prompt_part(outs: list[GenerateOutput]) -> GenerateOutput | None:
    """The sample's update that carries the prompt's logprobs."""
    return next((o for o in outs if o.prompt_logprobs is not None), None)


def prompt_logprobs(tok, ids: list[int], outs: list[GenerateOutput], top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, {id: {logprob, rank, decoded_token}} for
    the token itself and the ``top`` most likely in its place; the first token has none."""
    part = _prompt_part(outs)
    if part is None:
        return [None]
    alts = part.prompt_top or [[] for _ in part.prompt_logprobs]
    out: list[dict | None] = [None]
    for t, v, rank, row in zip(ids[1:], part.prompt_logprobs, part.prompt_ranks or [], alts, strict=False):
        entry = {str(t): {"logprob": v, "rank": rank, "decoded_token": token_text(tok, t)}}
        for r, (alt, alt_v) in enumerate(row[:top], start=1):
            entry.setdefault(str(alt), {"logprob": alt_v, "rank": r, "decoded_token": token_text(tok, alt)})
        out.append(entry)
    return out


def prompt_token_logprobs(tok, ids: list[int], outs: list[GenerateOutput], top: int) -> dict:
    """The echoed prompt's part of a completion's ``logprobs`` (its first token has none):
    each token's logprob and, as for generated tokens, the most likely in its place."""
    texts = [token_text(tok, t) for t in ids]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    part = _prompt_part(outs)
    values = part.prompt_logprobs if part else []
    tops = [{token_text(tok, t): v for t, v in row[:top]} for row in part.prompt_top] if part and part.prompt_top else None
    return {"tokens": texts, "token_logprobs": [None, *values][:len(ids)],
            "top_logprobs": ([None, *tops] if tops is not None else [None] * len(ids))[:len(ids)],
            "text_offset": offsets}


def token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_logprobs(tok, outs: list[GenerateOutput]) -> dict:
    content = []
    for out in outs:
        for lp in out.logprobs or []:
            text = token_text(tok, lp.token_id)
            content.append({
                "token": text, "logprob": lp.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := token_text(tok, i)), "logprob": v, "bytes": list(t.encode())}
                                 for i, v in lp.top],
            })
    return {"content": content}


def completion_logprobs(tok, outs: list[GenerateOutput], offset: int, head: dict | None = None) -> dict:
    """A completion choice's ``logprobs``; ``head``: the echoed prompt's, put first."""
    tokens, lps, tops, offsets = [], [], [], []
    for out in outs:
        for lp in out.logprobs or []:
            text = token_text(tok, lp.token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            lps.append(lp.logprob)
            tops.append({token_text(tok, i): v for i, v in lp.top})
    out = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
    return out if head is None else {k: head[k] + out[k] for k in out}

