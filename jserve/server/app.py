"""The Starlette app factory: `build_app(config, settings)` gives an ASGI app that loads the engine in the
background on start-up (so /health answers 503 meanwhile) and stops it on shut-down."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jserve.config import EngineConfig
from jserve.server import ollama_api, routes, scoring
from jserve.server.auth import KeyRing, load_api_keys
from jserve.server.http import EventStreamResponse, RequestContextMiddleware, error_response
from jserve.server.limits import Limits
from jserve.server.multi_model import ServedModel
from jserve.server.openapi import openapi_spec
from jserve.server.playground import playground_routes
from jserve.server.protocol import APIError
from jserve.server.state import ServerSettings, ServerState

Handler = Callable[[Request, ServerState], Awaitable[Response]]


def _endpoint(state: ServerState, handler: Handler, *, auth: bool, keys: KeyRing | None,
              limits: Limits) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        request.state.api_key, request.state.limits = None, limits
        try:
            if auth and keys is not None:
                request.state.api_key = keys.check(request.headers.get("authorization", ""))
            response = await handler(request, state)
        except APIError as e:
            response = error_response(e)
        if request.state.api_key is not None:  # the key's rate-limit state, on every response it gets
            _add_headers(response, limits.headers(request.state.api_key))
        return response

    return endpoint


def _add_headers(response: Response | EventStreamResponse, headers: dict[str, str]) -> None:
    if isinstance(response, EventStreamResponse):
        response.headers = [*response.headers, *((k.encode(), v.encode()) for k, v in headers.items())]
    else:
        response.headers.update(headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Unknown routes (404) and wrong methods (405) get OpenAI-shaped bodies too.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = exc.detail if isinstance(exc, HTTPException) else "internal server error"
    return error_response(APIError(status, f"{message}: {request.method} {request.url.path}"[:300]))


def build_app(config: EngineConfig | Sequence[ServedModel] | None = None, settings: ServerSettings | None = None, *,
              on_load_error: Callable[[BaseException], None] | None = None) -> Starlette:
    """An OpenAI-compatible app serving `config`'s model, or several models routed by the requests' `model`;
    `app.state.server` is its ServerState."""
    state = ServerState(config or EngineConfig(), settings or ServerSettings(), on_load_error)
    settings = state.settings
    # A bad keys file stops start-up here, with ApiKeysFileError naming the file and the entry.
    key_list = load_api_keys(settings.api_keys_file) if settings.api_keys_file else []
    keys = KeyRing.from_settings(settings.api_key, key_list)
    limits = state.make_limits(key_list)  # one per model, sharing the keys' buckets
    spec = openapi_spec(lora_updating=settings.allow_runtime_lora_updating)

    async def openapi(request: Request, _: ServerState) -> Response:
        return JSONResponse(spec)

    table = [("/v1/completions", ["POST"], routes.create_completion, True),
             ("/v1/chat/completions", ["POST"], routes.create_chat_completion, True),
             ("/v1/responses", ["POST"], routes.create_response, True),
             ("/v1/embeddings", ["POST"], routes.create_embedding, True),
             ("/v1/models", ["GET"], routes.list_models, True),
             ("/tokenize", ["POST"], routes.tokenize, True),
             ("/detokenize", ["POST"], routes.detokenize, True),
             ("/v1/load_lora_adapter", ["POST"], routes.load_lora_adapter, True),
             ("/v1/unload_lora_adapter", ["POST"], routes.unload_lora_adapter, True),
             ("/health", ["GET"], routes.health, False),
             ("/metrics", ["GET"], routes.metrics, False),
             ("/version", ["GET"], routes.version, False),
             ("/openapi.json", ["GET"], openapi, False),
             *scoring.ROUTES,  # vLLM's /score and /rerank, on an embedding model
             *ollama_api.ROUTES]  # Ollama's API, for the tools written against it

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            await state.shutdown()

    app = Starlette(routes=[Route(path, _endpoint(state, handler, auth=auth, keys=keys, limits=limits),
                                  methods=methods)
                            for path, methods, handler, auth in table] + playground_routes(),
                    middleware=[Middleware(RequestContextMiddleware)],
                    exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.server = state
    return app
