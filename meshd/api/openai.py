"""The OpenAI-compatible HTTP app: `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
and Prometheus `/metrics`, as a Starlette app for hypercorn's trio worker.

Request bodies are decoded with msgspec into the structs of `schemas.py` and checked by
`prepare.py`; every failure answers in OpenAI's error shape (`errors.py`). Generations run in
`responses.py` (streamed or whole, cancelled when the client goes away); authentication and
request metrics, and the Host, Origin and Content-Type rules (`origin_policy.py`) are ASGI
middleware (`auth.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from meshd.api.auth import (
    AuthMiddleware,
    BodyTimeoutMiddleware,
    MetricsMiddleware,
    OriginMiddleware,
)
from meshd.api.backend import MeshBackend
from meshd.api.console import PUBLIC_PATHS, StatusSource, console_routes
from meshd.api.errors import SERVER_ERROR, ApiError, bad_request, from_validation
from meshd.api.metrics import ApiMetrics
from meshd.api.origin_policy import OriginPolicy
from meshd.api.prepare import prepare_chat, prepare_completion, with_grammar
from meshd.api.responses import JSON, GenerationResponse
from meshd.api.routing import (
    RELAYED_HEADER,
    LocalModels,
    ModelCatalog,
    RelayCut,
    RelayedResponse,
    ServedModel,
    find_served,
    unknown_model,
)
from meshd.api.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from meshd.config.tables import ApiConfig
from meshd.speculative.config import SpecConfig

log = logging.getLogger(__name__)

EVENT_STREAM = "text/event-stream"

T = TypeVar("T")


class _State:
    """What the handlers share (one per app)."""

    def __init__(
        self,
        backend: MeshBackend,
        spec: SpecConfig,
        config: ApiConfig,
        metrics: ApiMetrics,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.backend = backend
        self.catalog: ModelCatalog = catalog or LocalModels([backend])
        self.spec = spec
        self.config = config
        self.metrics = metrics
        self.created = int(time.time())


def create_app(
    backend: MeshBackend,
    *,
    api_key: str | None = None,
    spec: SpecConfig | None = None,
    config: ApiConfig | None = None,
    metrics: ApiMetrics | None = None,
    status: StatusSource | None = None,
    catalog: ModelCatalog | None = None,
) -> Starlette:
    """The API app for `backend`.

    `api_key`: when set, every route requires `Authorization: Bearer <api_key>` (and
    `serve_api` refuses to bind beyond loopback without one). `spec`: the node's speculative
    settings, which a request's `meshd.speculative` keys override. `metrics`: give one to
    feed the daemon's hooks; by default the app makes its own (`app.state.metrics`).
    `status`: what the web console shows of the mesh (`meshctl status --json`'s object).
    `catalog`: the models of a mesh that serves several (`meshd/api/routing.py`); requests
    route by their `model` (default: `backend`'s model only).
    """
    state = _State(
        backend, spec or SpecConfig(), config or ApiConfig(), metrics or ApiMetrics(), catalog
    )
    policy = OriginPolicy.from_config(
        state.config.allowed_hosts,
        state.config.cors_origins,
        key_required=bool(api_key),
        public=PUBLIC_PATHS,
    )
    routes = [
        Route("/v1/models", _endpoint(state, _models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(state, _model), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(state, _chat), methods=["POST"]),
        Route("/v1/completions", _endpoint(state, _completions), methods=["POST"]),
        Route("/metrics", _endpoint(state, _metrics), methods=["GET"]),
        *console_routes(state.metrics, status, lambda: [m.name for m in state.catalog.served()]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(MetricsMiddleware, metrics=state.metrics),
            Middleware(OriginMiddleware, policy=policy),
            Middleware(AuthMiddleware, api_key=api_key, public=PUBLIC_PATHS),
            Middleware(BodyTimeoutMiddleware, timeout_s=state.config.body_timeout_s),
        ],
        exception_handlers={
            ApiError: _api_error_handler,
            ClientDisconnect: _client_gone_handler,
            HTTPException: _http_error_handler,
            Exception: _internal_error_handler,
        },
    )
    app.state.metrics = state.metrics
    app.state.requires_api_key = bool(api_key)
    return app


# -- handlers ---------------------------------------------------------------------------
Handler = Callable[[_State, Request], Awaitable[Response]]


def _endpoint(state: _State, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    return endpoint


async def _models(state: _State, request: Request) -> Response:
    return _json(ModelList([_card(state, m) for m in state.catalog.served()]))


async def _model(state: _State, request: Request) -> Response:
    name = request.path_params["model"]
    served = state.catalog.served()
    found = find_served(name, served)
    if found is None:
        raise unknown_model(name, served)
    return _json(_card(state, found))


def _card(state: _State, model: ServedModel) -> ModelCard:
    return ModelCard(id=model.name, created=state.created, max_model_len=model.max_context_tokens)


async def _chat(state: _State, request: Request) -> Response:
    arrived_s = time.perf_counter()
    raw = await _read_body(request, state.config)
    body = _decode(raw, ChatCompletionRequest)
    backend = state.catalog.local(body.model)
    if backend is None:
        return await _relay(state, request, body.model, raw)
    body = msgspec.structs.replace(body, model=backend.model_name)  # an alias names it too
    prepared = await with_grammar(prepare_chat(body, backend, state.spec), backend)
    return GenerationResponse(backend, state.metrics, prepared, arrived_s)


async def _completions(state: _State, request: Request) -> Response:
    arrived_s = time.perf_counter()
    raw = await _read_body(request, state.config)
    body = _decode(raw, CompletionRequest)
    backend = state.catalog.local(body.model)
    if backend is None:
        return await _relay(state, request, body.model, raw)
    body = msgspec.structs.replace(body, model=backend.model_name)
    prepared = prepare_completion(body, backend, state.spec)
    return GenerationResponse(backend, state.metrics, prepared, arrived_s)


async def _relay(state: _State, request: Request, model: str, raw: bytes) -> Response:
    """A model this node does not coordinate: relay the request to a node that serves it, or
    404 listing the models served."""
    relayed = None
    if not request.headers.get(RELAYED_HEADER):
        relayed = await state.catalog.relay(model, request.method, request.url.path, raw)
    if relayed is None:
        raise unknown_model(model, state.catalog.served())
    return _RelayResponse(relayed)


class _RelayResponse(Response):
    """Sends a holder's answer on as it arrives; a client that goes away cancels it there."""

    def __init__(self, relayed: RelayedResponse) -> None:
        super().__init__(status_code=relayed.status)
        self.relayed = relayed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relayed = self.relayed
        headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in relayed.headers
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        ]
        async with trio.open_nursery() as nursery:

            async def cancel_on_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_on_disconnect)
            try:
                await send(
                    {"type": "http.response.start", "status": relayed.status, "headers": headers}
                )
                tail = b""
                try:
                    async for chunk in relayed.body:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except RelayCut as exc:
                    if dict(relayed.headers).get("content-type", "").startswith(EVENT_STREAM):
                        # As a stage failure past recovery ends a stream: an error event.
                        error = ApiError(
                            503,
                            f"the node serving this model was lost mid-answer: {exc}",
                            type=SERVER_ERROR,
                            code="service_unavailable",
                        )
                        tail = b"data: " + error.encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            finally:
                await relayed.body.aclose()  # type: ignore[attr-defined]
            nursery.cancel_scope.cancel()


async def _metrics(state: _State, request: Request) -> Response:
    text, content_type = state.metrics.render()
    return Response(text, headers={"Content-Type": content_type})


async def _read_body(request: Request, config: ApiConfig) -> bytes:
    """The body, or 413 past `max_body_bytes` (after draining what the client still sends)."""
    limit = config.max_body_bytes
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        too_large = too_large or size > limit
        if not too_large:
            chunks.append(chunk)
        elif size > limit + config.max_drain_bytes:
            break
    if too_large:
        raise ApiError(
            413,
            f"request body too large: limit {limit} bytes",
            param=None,
            code="request_too_large",
            headers={"Connection": "close"},
        )
    return b"".join(chunks)


def _decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(value), status, headers, media_type=JSON)


# -- errors -----------------------------------------------------------------------------
def _error_response(error: ApiError) -> Response:
    return Response(error.encode(), error.status, error.headers, media_type=JSON)


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown route {request.method} {request.url.path}"
        return _error_response(ApiError(404, message, code="unknown_url"))
    return _error_response(ApiError(exc.status_code, str(exc.detail), code="http_error"))


class _NoResponse(Response):
    """Nothing to send: the client is gone."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


async def _client_gone_handler(request: Request, exc: Exception) -> Response:
    # The client hung up while sending its body: the metrics middleware counts it as 499
    # and logs it once; there is no one to answer.
    return _NoResponse()


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s", request.url.path, exc_info=exc)
    error = ApiError(500, "internal server error", type=SERVER_ERROR, code="internal_error")
    return _error_response(error)


# -- middleware -------------------------------------------------------------------------
