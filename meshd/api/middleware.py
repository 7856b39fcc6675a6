"""ASGI middleware of the API: bearer-key authentication and request metrics."""

from __future__ import annotations

import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.api.errors import ApiError
from meshd.api.metrics import ApiMetrics
from meshd.api.responses import CLIENT_GONE, send_error

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")


class AuthMiddleware:
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
        await send_error(send, error)

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False


class MetricsMiddleware:
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
