"""The OpenAI API's generation routes: ``/v1/chat/completions`` and ``/v1/completions``.

Bodies are parsed by ``protocol``; submission, collection and streaming by ``Generation``;
this module shapes OpenAI's response objects, stream chunks and logprobs (with vLLM's
extras: prompt logprobs, usage in every chunk, prompts cut to their last tokens); tools,
their grammar and the calls in outputs are ``tool_calls``'s.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd import __version__
from radixd.core.outputs import GenerateOutput
from radixd.server import protocol, tool_calls
from radixd.server.chat import chat_prompt_ids
from radixd.server.generation import Generation, samples, sse
from radixd.server.state import state_of


async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    body = await protocol.read_json(request)
    req = protocol.parse_chat(body, st.limits, st.model_name)
    parsed, ex = req.parsed, req.parsed.extras
    treq = tool_calls.read_request(body, st.tools)
    messages, tools = tool_calls.prompt(st.tools, treq, req.messages)
    params = tool_calls.constrain(st.tools, treq, parsed.params)
    ids = truncated(st, chat_prompt_ids(st, messages, add_generation_prompt=ex.add_generation_prompt,
                                        continue_final_message=ex.continue_final_message,
                                        template_kwargs=ex.template_kwargs, tools=tools), parsed)
    gen = await Generation.start(st, request, [ids], [params], priority=parsed.priority, shown=req.messages)
    calls = tool_calls.ToolOutputs(st.tools, treq, params.n)
    cid = f"chatcmpl-{gen.rid}"
    created = int(time.time())
    tok = st.engine.tokenizer

    if not parsed.stream:
        outs = (await gen.collect())[0]
        extra = {"prompt_logprobs": prompt_logprobs(tok, ids, outs)} if ex.prompt_logprobs else {}
        choices = [{
            "index": i,
            "message": calls.message(i, "".join(o.text for o in mine)),
            "logprobs": chat_logprobs(tok, mine) if params.logprobs else None,
            "finish_reason": calls.finish_reason(i, mine[-1].finish_reason),
        } for i, mine in enumerate(samples(outs, params.n))]
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": gen.usage(), "system_fingerprint": f"radixd-{__version__}", **extra,
        })

    async def events():
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": f"radixd-{__version__}"}
        event = chunks(gen, parsed.continuous_usage)
        for i in range(params.n):
            yield event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for _, out in gen.outputs():
            lp = chat_logprobs(tok, [out]) if params.logprobs and out.token_ids else None
            deltas = calls.deltas(out.index, out.text, out.finished) or ([{}] if lp or out.finished else [])
            for k, delta in enumerate(deltas):
                end = out.finished and k == len(deltas) - 1
                yield event({**base, "choices": [{
                    "index": out.index, "delta": delta, "logprobs": lp if k == 0 else None,
                    "finish_reason": calls.finish_reason(out.index, out.finish_reason) if end else None}]})
        if parsed.include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})

    return gen.stream(events)


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
        return echoes[pi], (prompt_token_logprobs(tok, prompts[pi], outs) if echo_lp else None)

    if not parsed.stream:
        results = await gen.collect()
        choices = [{
            "index": pi * n + i, "text": echoes[pi] + "".join(o.text for o in mine),
            "logprobs": (completion_logprobs(tok, mine, len(echoes[pi]), echoed(pi, mine)[1])
                         if params.logprobs else None),
            "finish_reason": mine[-1].finish_reason,
            **({"prompt_logprobs": prompt_logprobs(tok, prompts[pi], mine)} if parsed.extras.prompt_logprobs else {}),
        } for pi, outs in enumerate(results) for i, mine in enumerate(samples(outs, n))]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
                             "choices": choices, "usage": gen.usage()})

    async def events():
        base = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name}
        event = chunks(gen, parsed.continuous_usage)
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
            if out.text or out.token_ids or out.finished:
                yield event({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                "finish_reason": out.finish_reason if out.finished else None}]})
        if parsed.include_usage:
            yield event({**base, "choices": [], "usage": gen.usage()})

    return gen.stream(events)


def chunks(gen: Generation, continuous_usage: bool):
    """The stream's event framing: with ``continuous_usage`` every chunk carries the usage so far."""
    if not continuous_usage:
        return sse
    return lambda payload: sse({**payload, "usage": gen.usage()})


def truncated(st, ids: list[int], parsed: protocol.ParsedRequest) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (-1: as many as fit
    beside ``max_tokens`` in the context)."""
    keep = parsed.extras.truncate_prompt_tokens
    if keep == -1:
        keep = max(1, st.engine.context_len - parsed.params.max_new_tokens)
    return ids if keep is None else ids[-keep:]


def _prompt_values(outs: list[GenerateOutput]) -> list[float]:
    return next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), [])


def prompt_logprobs(tok, ids: list[int], outs: list[GenerateOutput]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, {id: {logprob, rank, decoded_token}}; the
    first token has none."""
    values = _prompt_values(outs)
    return [None] + [{str(t): {"logprob": v, "rank": None, "decoded_token": token_text(tok, t)}}
                     for t, v in zip(ids[1:], values, strict=False)]


def prompt_token_logprobs(tok, ids: list[int], outs: list[GenerateOutput]) -> dict:
    """The echoed prompt's part of a completion's ``logprobs`` (its first token has none; only
    the prompt tokens' own logprobs are known, so their ``top_logprobs`` are null)."""
    texts = [token_text(tok, t) for t in ids]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [None, *_prompt_values(outs)][:len(ids)],
            "top_logprobs": [None] * len(ids), "text_offset": offsets}


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

