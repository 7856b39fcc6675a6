"""ASGI middleware of the API: request metrics, bearer-key authentication, the body deadline."""

from __future__ import annotations

import hmac
import logging
import time

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.api.errors import ApiError
from meshd.api.metrics import ApiMetrics
from meshd.api.responses import CLIENT_GONE, send_error

log = logging.getLogger(__name__)

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every route when a key is set (constant-time check),
    except `public` paths (GET only: the console's static files, which hold no data)."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, public: frozenset[str] = frozenset()
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.key is None
            or scope["type"] != "http"
            or (scope["method"] in ("GET", "HEAD") and scope["path"] in self.public)
            or self._authorized(scope)
        ):
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
    """Counts requests by route and status, and times them.

    A client that goes away before its response is complete is counted once as 499 (nginx's
    code for it), whatever the app then did, and logged in one line: a hang-up is the
    client's doing, never a server error.
    """

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
        finished = False
        t0 = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        async def receive_and_note() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not finished:
                scope[CLIENT_GONE] = True
            return message

        self.metrics.request_started()
        try:
            await self.app(scope, receive_and_note, send_and_note)
        finally:
            duration_s = time.perf_counter() - t0
            if scope.get(CLIENT_GONE):
                status = 499
                log.info(
                    "client %s went away after %.1f s: %s %s counted as 499",
                    _client(scope), duration_s, scope["method"], path,
                )  # fmt: skip
            self.metrics.request_ended()
            self.metrics.request_done(route, status, duration_s)


class BodyTimeoutMiddleware:
    """The whole request body must arrive within `timeout_s` of the headers, else 408.

    A body that trickles in (one byte a second) would otherwise hold a connection and a task
    for as long as the client likes. The 408 carries `Connection: close`, and the server
    closes a connection whose request body was not read to its end.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = trio.current_time() + self.timeout_s
        body_done = False

        async def receive_by_deadline() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with trio.move_on_at(deadline):
                message = await receive()
                body_done = message["type"] != "http.request" or not message.get("more_body")
                return message
            log.info(
                "client %s sent too slow a body: %s %s closed with 408 after %.0f s",
                _client(scope), scope["method"], scope["path"], self.timeout_s,
            )  # fmt: skip
            raise ApiError(
                408,
                f"request body not received within {self.timeout_s:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            )

        await self.app(scope, receive_by_deadline, send)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"
