"""``POST /v1/embeddings``: OpenAI's embeddings API over an embedding engine (``Engine.embed``).

The body is read by ``protocol``'s table (``EMBEDDING_SCHEMAS``): ``input`` (a string, a list
of strings, a list of token ids or a list of token-id lists; none empty, as OpenAI refuses
empty strings), ``encoding_format`` (``float``, or ``base64``: little-endian float32 as
OpenAI sends it), ``dimensions`` (Matryoshka: the first N values, normalised again when the
model normalises). Every input is one embedding call, all submitted before any is awaited so
the scheduler batches them and they share cached prefixes (``Generation``: admission,
disconnects, usage, the request hooks). A model that does not embed answers 400 naming it.
"""

from __future__ import annotations

import base64
import struct

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd.core.engine import EMBED
from radixd.core.pooling import truncate
from radixd.server import protocol
from radixd.server.errors import ApiError
from radixd.server.generation import Generation
from radixd.server.state import state_of

_INPUT = ("'input' must be a non-empty string, a list of non-empty strings, a list of token ids or a list of "
          "non-empty token-id lists")


async def embeddings(request: Request) -> Response:
    st = state_of(request)
    body = await protocol.read_json(request)
    protocol.check_fields(body, set(protocol.EMBEDDING_SCHEMAS))
    protocol.check_model(body.get("model"), st.model_name)
    inputs = embedding_inputs(body)
    fmt = "float" if body.get("encoding_format") is None else body["encoding_format"]
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", param="user")
    pooling = st.engine.pooling
    if pooling is None:  # as SGLang and vLLM refuse embeddings from a generation model
        raise ApiError(400, f"the model '{st.model_name}' does not support embeddings: it generates text (serve "
                            "an embedding checkpoint, or set [model] task = \"embed\")", param="model",
                       code="model_not_supported")
    dims = body.get("dimensions")
    hidden = st.engine.model_cfg.hidden_size
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= hidden):
        raise ApiError(400, f"'dimensions' must be an integer in [1, {hidden}] (the model's embedding size), "
                            f"got {dims!r}", param="dimensions")
    gen = await Generation.start(st, request, inputs, [EMBED] * len(inputs), shown=inputs, embed=True)
    data = []
    for i, outs in enumerate(await gen.collect()):
        vec = outs[-1].embedding
        if dims is not None:
            vec = truncate(vec, dims, pooling.normalize)
        if fmt == "base64":
            vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
        data.append({"object": "embedding", "index": i, "embedding": vec})
    tokens = gen.prompt_tokens
    return JSONResponse({"object": "list", "data": data, "model": st.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def embedding_inputs(body: dict) -> list[str | list[int]]:
    """The body's ``input`` as one prompt (text or token ids) per embedding."""
    x = body.get("input")
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list) or not x:
        raise ApiError(400, _INPUT, param="input")
    if all(isinstance(t, str) for t in x):
        empty = next((i for i, t in enumerate(x) if not t), None)
        if empty is not None:
            where = "'input'" if isinstance(body["input"], str) else f"'input[{empty}]'"
            raise ApiError(400, f"{where} is an empty string; each input needs at least one token", param="input")
        return list(x)
    if all(_token(t) for t in x):
        return [list(x)]
    if all(isinstance(ids, list) and ids and all(_token(t) for t in ids) for ids in x):
        return [list(ids) for ids in x]
    raise ApiError(400, _INPUT, param="input")


def _token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
