"""ASGI middleware of the API: request metrics, the Host/Origin/Content-Type rules,
bearer-key authentication, the body deadline."""

from __future__ import annotations

import hmac
import logging
import time

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.api.errors import ApiError
from meshd.api.metrics import ApiMetrics
from meshd.api.origin_policy import AnswerPreflight, OriginPolicy, Refuse, Seen, cors_headers
from meshd.api.responses import CLIENT_GONE, send_error

log = logging.getLogger(__name__)

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")
# Scope key set on a request that another node relayed over an authenticated lane: it never
# came through a socket, and the node that took it from its client already checked it.
IN_PROCESS = "meshd.in_process"


class OriginMiddleware:
    """Applies `OriginPolicy` (`origin_policy.py`): refuses a request under a foreign Host,
    from a foreign Origin, or with a body that is not JSON; answers CORS preflights of the
    allowed origins, and adds the CORS headers to their responses."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(IN_PROCESS):
            await self.app(scope, receive, send)
            return
        verdict = self.policy.decide(_seen(scope))
        if isinstance(verdict, AnswerPreflight):
            raw = [(k.lower().encode(), v.encode()) for k, v in verdict.headers.items()]
            raw.append((b"content-length", b"0"))
            await send({"type": "http.response.start", "status": 204, "headers": raw})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if verdict.cors_origin is not None:
            extra = [(k.lower().encode(), v.encode())
                     for k, v in cors_headers(verdict.cors_origin).items()]  # fmt: skip
            inner = send

            async def send_with_cors(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await inner(message)

            send = send_with_cors
        if isinstance(verdict, Refuse):
            log.debug(
                "refused %s %s from %s: %s",
                scope["method"], scope["path"], _client(scope), verdict.error.message,
            )  # fmt: skip
            await send_error(send, verdict.error)
            return
        await self.app(scope, receive, send)


def _seen(scope: Scope) -> Seen:
    headers: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name, value)  # the first of a repeated header

    def text(name: bytes) -> str | None:
        value = headers.get(name)
        return value.decode("latin-1") if value is not None else None

    method = scope["method"]
    length = headers.get(b"content-length")
    if scope.get("http_version", "1.1").startswith("1"):
        has_body = b"transfer-encoding" in headers or length not in (None, b"0")
    else:  # HTTP/2 frames a body without either header
        has_body = length != b"0"
    origin = text(b"origin")
    return Seen(
        method=method,
        path=scope["path"],
        scheme=scope.get("scheme", "http"),
        server=scope.get("server"),
        host=text(b"host"),
        origin=origin,
        content_type=text(b"content-type"),
        has_body=has_body,
        preflight=method == "OPTIONS"
        and origin is not None
        and b"access-control-request-method" in headers,
        request_headers=text(b"access-control-request-headers"),
    )


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
