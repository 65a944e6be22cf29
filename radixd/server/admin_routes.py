"""Model listing, health, metrics and inspection routes (``/v1/models``, ``/health`` (and
SGLang's ``/health_generate``), ``/metrics``, ``/flush_cache``, ``/server_info``, SGLang's ``/v1/loads``,
``/openapi.json``)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixd import __version__
from radixd.core.errors import EngineStopped, InvalidRequest
from radixd.core.sampling_params import SamplingParams
from radixd.server import protocol
from radixd.server.engine_load import check_include
from radixd.server.errors import ApiError
from radixd.server.state import ServerState, state_of


async def models(request: Request) -> Response:
    st = state_of(request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


async def model_by_id(request: Request) -> Response:
    st = state_of(request)
    protocol.check_model(request.path_params["model"], st.model_name)
    return JSONResponse(_model_card(st))


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "radixd",
            "max_model_len": st.engine.context_len}


async def health(request: Request) -> Response:
    """200 only if the batching loop is alive and completes a one-token generation (an embedding
    model: a one-token embedding) in time."""
    st = state_of(request)
    if st.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    stalled = st.stalled()
    if stalled:
        return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
    t0 = time.perf_counter()
    try:
        one = [st.engine.eos_token_ids[0] if st.engine.eos_token_ids else 0]
        sub = (st.engine.embed(input_ids=one) if st.engine.pooling is not None else  # (an embedding model)
               st.engine.submit(input_ids=one, params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)))
        async with asyncio.timeout(st.settings.server.health_timeout_s):
            async for _ in sub:
                pass
    except TimeoutError:
        sub.close()
        return JSONResponse({"status": "generation timed out"}, status_code=503)
    except (EngineStopped, InvalidRequest) as exc:
        return JSONResponse({"status": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok", "generate_ms": round((time.perf_counter() - t0) * 1000, 2)})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    st = state_of(request)
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def flush_cache(request: Request) -> Response:
    """GET or POST, as SGLang's: 400 while running requests hold the cache."""
    st = state_of(request)
    if not st.engine.flush_cache():
        raise ApiError(400, "the cache is in use by running requests; retry when idle", code="cache_in_use")
    return JSONResponse({"flushed": True})


async def server_info(request: Request) -> Response:
    """radixd's own body, with SGLang's server arguments beside it (``/server_info`` is also
    SGLang's newer name of ``/get_server_info``, which its gateway reads)."""
    st = state_of(request)
    return JSONResponse({**sglang_server_args(st), **server_info_body(st)})


def sglang_server_args(st: ServerState) -> dict:
    """radixd's settings under the names of SGLang's server arguments."""
    s = st.settings
    return {
        "model_path": s.model.path, "tokenizer_path": s.model.tokenizer or s.model.path,
        "served_model_name": st.model_name, "host": s.server.host, "port": s.server.port,
        "context_length": st.engine.context_len, "tp_size": s.parallel.tp_size, "dp_size": s.parallel.dp_size,
        "mem_fraction_static": s.memory.mem_fraction, "chunked_prefill_size": s.scheduler.chunked_prefill_size,
        "max_running_requests": s.scheduler.max_running_requests, "schedule_policy": s.scheduler.policy,
        "disable_radix_cache": not s.cache.radix, "stream_interval": s.scheduler.stream_interval,
        "log_level": s.logging.level, "random_seed": s.scheduler.seed,
        "max_total_tokens": st.engine.stats()["kv"]["total"], "is_embedding": st.engine.pooling is not None,
        "reasoning_parser": getattr(st.reasoning, "name", None),
    }


async def loads(request: Request) -> Response:
    """SGLang's ``GET /v1/loads`` (``?include=`` sections; radixd answers the core figures):
    what SGLang's gateway polls for its load-aware policies."""
    st = state_of(request)
    check_include(request.query_params.get("include"))
    return JSONResponse(st.metrics.load.loads_body(st.settings.scheduler.max_running_requests))


def server_info_body(st: ServerState) -> dict:
    """Version, settings (no keys), engine statistics, plugins."""
    settings = asdict(st.settings)
    settings.pop("auth", None)  # never expose keys
    return {
        "version": __version__, "model": st.model_name, "context_len": st.engine.context_len,
        "device": str(st.engine.device), "dtype": str(st.engine.dtype).removeprefix("torch."),
        "settings": settings, "stats": st.engine.stats(), "draining": st.draining,
        "plugins": [name for name, plugin in st.plugins.list_name_plugin() if plugin is not None],
    }



async def openapi(request: Request) -> Response:
    from radixd.server.openapi import openapi_document

    return JSONResponse(openapi_document(state_of(request)))
