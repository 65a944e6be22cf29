"""radixd's native routes: SGLang-style ``/generate`` and the tokenizer routes
(``/v1/tokenize``, ``/v1/detokenize``, ``/apply_chat_template``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd.core.outputs import GenerateOutput, Submission
from radixd.server import protocol
from radixd.server.chat import chat_prompt_ids
from radixd.server.errors import ApiError
from radixd.server.generation import Generation, samples, sse
from radixd.server.state import state_of


async def native_generate(request: Request) -> Response:
    """``text`` or ``input_ids`` plus ``sampling_params``. A list of texts (or of token-id
    lists) is a batch, submitted together (so its prompts share a step), with one
    ``sampling_params`` for all or a list of one per prompt; a batch does not stream and its
    answer is a list, one entry per prompt."""
    st = state_of(request)
    req = protocol.parse_native(await protocol.read_json(request))
    gen = await Generation.start(st, request, req.prompts, req.params, priority=req.priority,
                                 param_prefix="sampling_params.")

    if not req.stream:
        answers = []
        for sub, ps, outs in zip(gen.subs, req.params, await gen.collect(), strict=True):
            items = []
            for i, mine in enumerate(samples(outs, ps.n)):
                plp = next((o.prompt_logprobs for o in mine if o.prompt_logprobs is not None), None)
                items.append(_item(sub, i, "".join(o.text for o in mine), [t for o in mine for t in o.token_ids],
                                   mine[-1] if mine else None, plp))
            answers.append(items[0] if ps.n == 1 else items)
        return JSONResponse(answers if req.batch else answers[0])

    sub = gen.subs[0]

    async def events():
        texts: dict[int, str] = {}
        toks: dict[int, list[int]] = {}
        async for _, out in gen.outputs():
            texts[out.index] = texts.get(out.index, "") + out.text
            toks.setdefault(out.index, []).extend(out.token_ids)
            yield sse(_item(sub, out.index, texts[out.index], toks[out.index], out, out.prompt_logprobs))

    return gen.stream(events)


def _item(sub: Submission, i: int, text: str, ids: list[int], last: GenerateOutput | None,
          prompt_lp: list[float] | None = None) -> dict:
    meta = {"id": sub.rid, "finish_reason": last.finish_reason if last and last.finished else None,
            "prompt_tokens": sub.prompt_tokens, "completion_tokens": len(ids),
            "cached_tokens": last.cached_tokens if last else 0}
    if prompt_lp is not None:
        meta["prompt_logprobs"] = prompt_lp
    return {"index": i, "text": text, "output_ids": ids, "meta_info": meta}


async def tokenize(request: Request) -> Response:
    st = state_of(request)
    req = protocol.parse_tokenize(await protocol.read_json(request), st.model_name)
    if req.messages is not None:
        ids = chat_prompt_ids(st, req.messages)
    else:
        ids = st.engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": st.engine.context_len})


async def detokenize(request: Request) -> Response:
    st = state_of(request)
    toks = protocol.parse_detokenize(await protocol.read_json(request), st.model_name,
                                     st.engine.model_cfg.vocab_size)
    return JSONResponse({"prompt": st.engine.tokenizer.decode(toks)})


async def apply_chat_template(request: Request) -> Response:
    """Render chat messages with the model's template, as text (clients building prompts
    turn by turn, such as ``radixd.lang``, use it to find each role's wrapping)."""
    st = state_of(request)
    messages, gen = protocol.parse_template(await protocol.read_json(request), st.model_name)
    if st.engine.tokenizer is None:
        raise ApiError(400, "this server runs without a tokenizer", param="messages")
    try:
        text = st.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as exc:  # the template itself refused (a jinja raise_exception)
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    return JSONResponse({"text": text})
