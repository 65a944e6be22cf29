"""radixd's native routes: SGLang's native API (``/generate``, ``/get_model_info``,
``/get_server_info``, ``/abort_request``; ``/health_generate`` and ``/flush_cache`` are
``admin_routes``') and the tokenizer routes (``/v1/tokenize``, ``/v1/detokenize``,
``/apply_chat_template``)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd import __version__
from radixd.core.outputs import GenerateOutput, Submission
from radixd.server import native_protocol, protocol
from radixd.server.admin_routes import server_info_body, sglang_server_args
from radixd.server.chat import chat_prompt_ids
from radixd.server.errors import ApiError
from radixd.server.generation import Generation, samples
from radixd.server.native_protocol import NativeRequest
from radixd.server.sse import frame_json
from radixd.server.state import ServerState, state_of


async def native_generate(request: Request) -> Response:
    """SGLang's ``/generate``: ``text`` or ``input_ids`` plus ``sampling_params``. A list of
    texts (or of token-id lists) is a batch, submitted together (so its prompts share a step),
    with one ``sampling_params`` for all or a list of one per prompt; a batch does not stream
    and its answer is a list, one entry per prompt. A stream's events carry the text so far."""
    t0 = time.perf_counter()
    st = state_of(request)
    req = native_protocol.parse_native(await protocol.read_json(request), st.engine.tokenize)
    gen = await Generation.start(st, request, req.prompts, req.params, priority=req.priority,
                                 param_prefix="sampling_params.", rids=req.rids)
    answer = _Answer(st, req, t0)

    if not req.stream:
        answers = []
        for k, (sub, ps, outs) in enumerate(zip(gen.subs, req.params, await gen.collect(), strict=True)):
            items = [answer.item(k, sub, i, _Sample(mine)) for i, mine in enumerate(samples(outs, ps.n))]
            answers.append(items[0] if ps.n == 1 else items)
        return JSONResponse(answers if req.batch else answers[0])

    sub = gen.subs[0]

    async def events():
        seen: dict[int, _Sample] = {}
        async for _, out in gen.outputs():
            sample = seen.setdefault(out.index, _Sample([]))
            sample.add(out)
            yield frame_json(answer.item(0, sub, out.index, sample))

    return gen.stream(events)


class _Sample:
    """One sample's outputs so far, accumulated (a stream's events carry the whole text)."""

    def __init__(self, outs: list[GenerateOutput]):
        self.text, self.ids, self.lps = "", [], []
        self.prompt_lp: list[float] | None = None
        self.prompt_top: list[list[tuple[int, float]]] | None = None
        self.last: GenerateOutput | None = None
        for out in outs:
            self.add(out)

    def add(self, out: GenerateOutput) -> None:
        self.text += out.text
        self.ids.extend(out.token_ids)
        self.lps.extend(out.logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt_lp, self.prompt_top = out.prompt_logprobs, out.prompt_top
        self.last = out


class _Answer:
    """One sample's answer in SGLang's shape: ``text``, ``output_ids`` and ``meta_info``
    (token counts, ``finish_reason``, logprobs as ``[logprob, token_id, text or None]``)."""

    def __init__(self, st: ServerState, req: NativeRequest, t0: float):
        self.st, self.req, self.t0 = st, req, t0

    def item(self, k: int, sub: Submission, i: int, sample: _Sample) -> dict:
        ask, last, plp = self.req.logprobs[k], sample.last, sample.prompt_lp
        ids, text, lps = sample.ids, sample.text, sample.lps
        finish = last.finish_object() if last else None
        if ask is not None and ask.drop_output:
            ids, text, lps = [], "", []
            finish = {"type": "length", "length": 0}
        meta = {"id": sub.rid, "finish_reason": finish,
                "prompt_tokens": sub.prompt_tokens, "completion_tokens": len(ids),
                "cached_tokens": last.cached_tokens if last else 0,
                "e2e_latency": round(time.perf_counter() - self.t0, 6)}
        if plp is not None:
            meta["prompt_logprobs"] = plp
        if ask is not None:
            prompt = self.req.prompts[k]
            # position 0 has no logprob; the engine's start from position max(start, 1)
            values = ([None] if ask.start == 0 else []) + list(plp or [])
            meta["input_token_logprobs"] = [self._entry(v, t) for v, t in zip(values, prompt[ask.start:], strict=False)]
            meta["output_token_logprobs"] = [self._entry(lp.logprob, lp.token_id) for lp in lps]
            if ask.top:
                first = [None] if ask.start == 0 else []
                meta["input_top_logprobs"] = first + [[self._entry(v, t) for t, v in row] for row in sample.prompt_top or []]
                meta["output_top_logprobs"] = [[self._entry(v, t) for t, v in lp.top] for lp in lps]
        elif self.req.params[k].logprobs:
            meta["output_token_logprobs"] = [self._entry(lp.logprob, lp.token_id) for lp in lps]
        return {"index": i, "text": text, "output_ids": ids, "meta_info": meta}

    def _entry(self, logprob: float | None, token: int) -> list:
        shown = self.st.engine.tokenizer.decode([token]) if self.req.text_in_logprobs else None
        return [logprob, token, shown]


async def get_model_info(request: Request) -> Response:
    """SGLang's ``/model_info`` and its older name ``/get_model_info`` (its frontend reads it at
    construction, its gateway when a worker registers)."""
    st = state_of(request)
    model = st.settings.model
    return JSONResponse({"model_path": model.path, "tokenizer_path": model.tokenizer or model.path,
                         "is_generation": st.engine.pooling is None, "preferred_sampling_params": None,
                         "served_model_name": st.model_name})


async def get_server_info(request: Request) -> Response:
    """SGLang's ``/get_server_info``: its server arguments (radixd's settings under SGLang's
    names), the engine's state per replica, the version; and radixd's own ``/server_info``."""
    st = state_of(request)
    return JSONResponse({**sglang_server_args(st), "internal_states": [st.engine.stats()], "version": __version__,
                         "radixd": server_info_body(st)})


async def abort_request(request: Request) -> Response:
    """SGLang's ``/abort_request``: ``rid`` (or ``abort_all``); 200 whether or not it ran."""
    st = state_of(request)
    rid, abort_all = protocol.parse_abort(await protocol.read_json(request))
    if abort_all:
        st.engine.abort_all()
    elif rid is not None:
        await st.engine.abort(rid)
    return Response(status_code=200)


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
        text = st.engine.tokenizer.apply_chat_template(st.tools.history(messages), tokenize=False,
                                                       add_generation_prompt=gen)
    except Exception as exc:  # the template itself refused (a jinja raise_exception)
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
    return JSONResponse({"text": text})
