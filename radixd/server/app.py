"""The starlette application: the route table over one ``Engine``, and its error handlers.

Routes live by concern: ``openai_routes`` (chat completions, completions), ``responses``
(the Responses API over chat), ``embedding_routes`` (embeddings), ``native_routes`` (SGLang's
native API, the tokenizer routes), ``admin_routes`` (models, health, metrics, inspection);
plugins add theirs through ``radixd_routes``. Every request passes the ``Gate``
(``radixd.server.gate``); every error leaves as OpenAI's error JSON.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixd.server import dashboard
from radixd.server.admin_routes import (
    flush_cache,
    health,
    loads,
    metrics,
    model_by_id,
    models,
    openapi,
    server_info,
)
from radixd.server.embedding_routes import embeddings
from radixd.server.errors import ApiError
from radixd.server.gate import ErrorsAsJsonGate
from radixd.server.native_routes import (
    abort_request,
    apply_chat_template,
    detokenize,
    get_model_info,
    get_server_info,
    native_generate,
    tokenize,
)
from radixd.server.openai_routes import chat_completions, completions
from radixd.server.responses import create_response
from radixd.server.state import ServerState, state_of

__all__ = ["ServerState", "build_app"]


async def _api_error(request: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.url.path}").response()
    return ApiError(exc.status_code, str(exc.detail)).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    state_of(request).log.exception("unhandled error", path=request.url.path)
    return ApiError(500, "internal server error").response()


def build_app(state: ServerState) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_by_id, methods=["GET"]),
        Route("/generate", native_generate, methods=["POST"]),
        Route("/apply_chat_template", apply_chat_template, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/dashboard", dashboard.page, methods=["GET"]), Route("/dashboard/events", dashboard.events, methods=["GET"]),
    ]
    for extra in state.plugins.hook.radixd_routes(state=state):
        routes.extend(extra or [])
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.radixd = state
    app.add_middleware(ErrorsAsJsonGate, state=state)
    origins = list(state.settings.server.cors_origins)
    if origins:  # outside the gate: a browser's preflight carries no API key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"], max_age=600)
    return app

