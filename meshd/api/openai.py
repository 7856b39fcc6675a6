"""The OpenAI-compatible HTTP app: `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
and Prometheus `/metrics`, as a Starlette app for hypercorn's trio worker.

Request bodies are decoded with msgspec into the structs of `schemas.py` and checked by
`prepare.py`; every failure answers in OpenAI's error shape (`errors.py`). A generation runs
while a watcher waits for the client's `http.disconnect`: a client that goes away cancels its
generation, and the coordinator then frees the session's KV on every stage. A streamed
response sends its headers only with its first event, so a backend that refuses the request
(429, 503) still answers with a proper status rather than an error inside a 200 stream.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.api.backend import MeshBackend
from meshd.api.errors import SERVER_ERROR, ApiError, bad_request, from_validation
from meshd.api.metrics import ApiMetrics
from meshd.api.prepare import Prepared, check_model, prepare_chat, prepare_completion
from meshd.api.runner import Outcome, run_generation
from meshd.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionRequest,
    MeshdInfo,
    ModelCard,
    ModelList,
    TextChoice,
)
from meshd.spec.config import SpecConfig

log = logging.getLogger(__name__)

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")
JSON = "application/json"
CLIENT_GONE = "meshd.client_gone"  # scope key: the client disconnected before the end
T = TypeVar("T")


class ApiConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Limits of the HTTP layer."""

    # Largest request body accepted (413 beyond).
    max_body_bytes: int = 4 * 1024 * 1024
    # A refused oversized body is still read (and dropped) up to this much, so that the client
    # finishes sending and can read the 413 instead of a reset connection.
    max_drain_bytes: int = 64 * 1024 * 1024


class _State:
    """What the handlers share (one per app)."""

    def __init__(
        self, backend: MeshBackend, spec: SpecConfig, config: ApiConfig, metrics: ApiMetrics
    ) -> None:
        self.backend = backend
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
) -> Starlette:
    """The API app for `backend`.

    `api_key`: when set, every route requires `Authorization: Bearer <api_key>` (and
    `serve_api` refuses to bind beyond loopback without one). `spec`: the node's speculative
    settings, which a request's `meshd.speculative` keys override. `metrics`: give one to
    feed the daemon's hooks; by default the app makes its own (`app.state.metrics`).
    """
    state = _State(backend, spec or SpecConfig(), config or ApiConfig(), metrics or ApiMetrics())
    routes = [
        Route("/v1/models", _endpoint(state, _models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint(state, _model), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(state, _chat), methods=["POST"]),
        Route("/v1/completions", _endpoint(state, _completions), methods=["POST"]),
        Route("/metrics", _endpoint(state, _metrics), methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(_MetricsMiddleware, metrics=state.metrics),
            Middleware(_AuthMiddleware, api_key=api_key),
        ],
        exception_handlers={
            ApiError: _api_error_handler,
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
    return _json(ModelList([_card(state)]))


async def _model(state: _State, request: Request) -> Response:
    check_model(request.path_params["model"], state.backend)
    return _json(_card(state))


def _card(state: _State) -> ModelCard:
    b = state.backend
    return ModelCard(id=b.model_name, created=state.created, max_model_len=b.max_context_tokens)


async def _chat(state: _State, request: Request) -> Response:
    arrived_s = time.perf_counter()
    body = _decode(await _read_body(request, state.config), ChatCompletionRequest)
    prepared = prepare_chat(body, state.backend, state.spec)
    return _GenerationResponse(state, prepared, arrived_s)


async def _completions(state: _State, request: Request) -> Response:
    arrived_s = time.perf_counter()
    body = _decode(await _read_body(request, state.config), CompletionRequest)
    prepared = prepare_completion(body, state.backend, state.spec)
    return _GenerationResponse(state, prepared, arrived_s)


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


# -- the generation response ------------------------------------------------------------
class _GenerationResponse(Response):
    """Runs the generation while the response is sent (streamed as SSE, or as one JSON)."""

    def __init__(self, state: _State, prepared: Prepared, arrived_s: float) -> None:
        super().__init__(status_code=200)
        self.state = state
        self.prepared = prepared
        self.arrived_s = arrived_s
        prefix = "chatcmpl-" if prepared.kind == "chat" else "cmpl-"
        self.id = prefix + secrets.token_hex(12)
        self.created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = self._stream if self.prepared.stream else self._whole
        error: Exception | None = None
        finished = False

        async def send_noting_end(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True  # a disconnect from now on is the normal end of the exchange
            await send(message)

        async def cancel_on_disconnect(cancel_scope: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                scope[CLIENT_GONE] = True  # for the metrics middleware
                cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, nursery.cancel_scope)
            try:
                await respond(send_noting_end)
            except Exception as exc:  # re-raised below, outside the nursery's exception group
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _run(self, emit: Callable[[str], Awaitable[None]]) -> Outcome:
        return await run_generation(
            self.state.backend, self.prepared, self.state.metrics, emit, arrived_s=self.arrived_s
        )

    async def _whole(self, send: Send) -> None:
        pieces: list[str] = []

        async def collect(text: str) -> None:
            pieces.append(text)

        try:
            outcome = await self._run(collect)
        except ApiError as exc:
            await _send_error(send, exc)
            return
        text = "".join(pieces)
        info = MeshdInfo(outcome.telemetry)
        body: ChatCompletion | Completion
        if self.prepared.kind == "chat":
            choice = ChatChoice(AssistantMessage(text), outcome.finish_reason)
            body = ChatCompletion(
                id=self.id, created=self.created, model=self.prepared.model, choices=[choice],
                usage=outcome.usage, meshd=info,
            )  # fmt: skip
        else:
            body = Completion(
                id=self.id, created=self.created, model=self.prepared.model,
                choices=[TextChoice(text, outcome.finish_reason)], usage=outcome.usage, meshd=info,
            )  # fmt: skip
        await _send_whole(send, 200, msgspec.json.encode(body), {})

    async def _stream(self, send: Send) -> None:
        sse = _EventSender(send)
        usage_field: msgspec.UnsetType | None = (
            None if self.prepared.include_usage else msgspec.UNSET
        )
        chat = self.prepared.kind == "chat"

        async def emit(text: str) -> None:
            if chat and not sse.started:
                await sse.event(
                    self._chat_chunk(ChatDelta(role="assistant", content=""), usage=usage_field)
                )
            chunk = (
                self._chat_chunk(ChatDelta(content=text), usage=usage_field)
                if chat
                else self._text_chunk(text, usage=usage_field)
            )
            await sse.event(chunk)

        try:
            outcome = await self._run(emit)
        except ApiError as exc:
            if not sse.started:
                await _send_error(send, exc)
                return
            await sse.raw(exc.encode())  # OpenAI clients raise on an `error` event
            await sse.done()
            return
        except Exception as exc:
            if not sse.started:
                raise
            log.exception("generation failed mid-stream")
            error = ApiError(
                500, f"internal error: {exc}", type=SERVER_ERROR, code="internal_error"
            )
            await sse.raw(error.encode())
            await sse.done()
            return
        info = MeshdInfo(outcome.telemetry)
        if chat:
            if not sse.started:
                await sse.event(
                    self._chat_chunk(ChatDelta(role="assistant", content=""), usage=usage_field)
                )
            final: ChatCompletionChunk | Completion = self._chat_chunk(
                ChatDelta(), outcome.finish_reason, usage=usage_field, meshd=info
            )
        else:
            final = self._text_chunk("", outcome.finish_reason, usage=usage_field, meshd=info)
        await sse.event(final)
        if self.prepared.include_usage:
            if chat:
                await sse.event(self._chat_usage(outcome))
            else:
                await sse.event(self._text_usage(outcome))
        await sse.done()

    def _chat_chunk(
        self,
        delta: ChatDelta,
        finish: Any = None,
        *,
        usage: Any = msgspec.UNSET,
        meshd: Any = msgspec.UNSET,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.prepared.model,
            choices=[ChatChunkChoice(delta, finish)], usage=usage, meshd=meshd,
        )  # fmt: skip

    def _text_chunk(
        self,
        text: str,
        finish: Any = None,
        *,
        usage: Any = msgspec.UNSET,
        meshd: Any = msgspec.UNSET,
    ) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.prepared.model,
            choices=[TextChoice(text, finish)], usage=usage, meshd=meshd,
        )  # fmt: skip

    def _chat_usage(self, outcome: Outcome) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.prepared.model, choices=[],
            usage=outcome.usage,
        )  # fmt: skip

    def _text_usage(self, outcome: Outcome) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.prepared.model, choices=[],
            usage=outcome.usage,
        )  # fmt: skip


class _EventSender:
    """Server-sent events: headers with the first event, `data: [DONE]` at the end."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def event(self, value: Any) -> None:
        await self.raw(msgspec.json.encode(value))

    async def raw(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
            ]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )

    async def done(self) -> None:
        await self.raw(b"[DONE]")
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_error(send: Send, error: ApiError) -> None:
    await _send_whole(send, error.status, error.encode(), error.headers)


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


async def _internal_error_handler(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s", request.url.path, exc_info=exc)
    error = ApiError(500, "internal server error", type=SERVER_ERROR, code="internal_error")
    return _error_response(error)


# -- middleware -------------------------------------------------------------------------
class _AuthMiddleware:
    """`Authorization: Bearer <key>` on every route when a key is set (constant-time check)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            401,
            "Incorrect or missing API key: send Authorization: Bearer <api_key>",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await _send_error(send, error)

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


class _MetricsMiddleware:
    """Counts requests by route and status, and times them."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = (
            path if path in ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
        )
        status = 500  # if the app fails before starting a response
        t0 = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if scope.get(CLIENT_GONE):
                status = 499  # the client went away (nginx's code for it)
            self.metrics.in_flight.dec()
            self.metrics.request_done(route, status, time.perf_counter() - t0)
