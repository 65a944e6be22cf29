"""The OpenAI API's generation routes: ``/v1/chat/completions`` and ``/v1/completions``.

Bodies are parsed by ``protocol``; submission, collection and streaming by ``Generation``;
this module shapes OpenAI's response objects, stream chunks and logprobs.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd import __version__
from radixd.core.outputs import GenerateOutput
from radixd.server import protocol
from radixd.server.chat import chat_prompt_ids
from radixd.server.generation import Generation, samples, sse
from radixd.server.state import state_of


async def chat_completions(request: Request) -> Response:
    st = state_of(request)
    req = protocol.parse_chat(await protocol.read_json(request), st.limits, st.model_name)
    parsed, params = req.parsed, req.parsed.params
    ids = chat_prompt_ids(st, req.messages)
    gen = await Generation.start(st, request, [ids], [params], priority=parsed.priority, shown=req.messages)
    cid = f"chatcmpl-{gen.rid}"
    created = int(time.time())
    tok = st.engine.tokenizer

    if not parsed.stream:
        outs = (await gen.collect())[0]
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": "".join(o.text for o in mine)},
            "logprobs": chat_logprobs(tok, mine) if params.logprobs else None,
            "finish_reason": mine[-1].finish_reason,
        } for i, mine in enumerate(samples(outs, params.n))]
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": gen.usage(), "system_fingerprint": f"radixd-{__version__}",
        })

    async def events():
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": f"radixd-{__version__}"}
        for i in range(params.n):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for _, out in gen.outputs():
            lp = chat_logprobs(tok, [out]) if params.logprobs and out.token_ids else None
            if out.text or lp or out.finished:
                yield sse({**base, "choices": [{
                    "index": out.index, "delta": {"content": out.text} if out.text else {}, "logprobs": lp,
                    "finish_reason": out.finish_reason if out.finished else None}]})
        if parsed.include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage()})

    return gen.stream(events)


async def completions(request: Request) -> Response:
    st = state_of(request)
    req = protocol.parse_completion(await protocol.read_json(request), st.limits, st.model_name)
    parsed, params, prompts = req.parsed, req.parsed.params, req.prompts
    gen = await Generation.start(st, request, prompts, [params] * len(prompts), priority=parsed.priority)
    tok = st.engine.tokenizer
    n = params.n
    cid = f"cmpl-{gen.rid}"
    created = int(time.time())
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts]

    if not parsed.stream:
        results = await gen.collect()
        choices = [{
            "index": pi * n + i, "text": echoes[pi] + "".join(o.text for o in mine),
            "logprobs": completion_logprobs(tok, mine, len(echoes[pi])) if params.logprobs else None,
            "finish_reason": mine[-1].finish_reason,
        } for pi, outs in enumerate(results) for i, mine in enumerate(samples(outs, n))]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": st.model_name,
                             "choices": choices, "usage": gen.usage()})

    async def events():
        base = {"id": cid, "object": "text_completion", "created": created, "model": st.model_name}
        offsets: dict[int, int] = {}
        if req.echo:
            for pi in range(len(prompts)):
                for i in range(n):
                    yield sse({**base, "choices": [{"index": pi * n + i, "text": echoes[pi], "logprobs": None,
                                                    "finish_reason": None}]})
        async for pi, out in gen.outputs():
            idx = pi * n + out.index
            lp = None
            if params.logprobs:
                lp = completion_logprobs(tok, [out], offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(out.text)
            if out.text or out.token_ids or out.finished:
                yield sse({**base, "choices": [{"index": idx, "text": out.text, "logprobs": lp,
                                                "finish_reason": out.finish_reason if out.finished else None}]})
        if parsed.include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage()})

    return gen.stream(events)


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


def completion_logprobs(tok, outs: list[GenerateOutput], offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for out in outs:
        for lp in out.logprobs or []:
            text = token_text(tok, lp.token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            lps.append(lp.logprob)
            tops.append({token_text(tok, i): v for i, v in lp.top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

