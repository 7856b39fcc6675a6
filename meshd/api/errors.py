"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the API reports is an `ApiError` carrying its HTTP status; handlers raise it and
one place renders it, so a client library that understands OpenAI's errors understands ours.
"""

from __future__ import annotations

import math
import re

import msgspec

from meshd.api.backend import Overloaded, ServiceUnavailable

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class ErrorBody(msgspec.Struct, frozen=True):
    """The inner object of an error response."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, frozen=True):
    """`{"error": {...}}`."""

    error: ErrorBody


class ApiError(Exception):
    """An error to send to the client, with its HTTP status and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        """The JSON body."""
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def encode(self) -> bytes:
        """The JSON body, encoded."""
        return msgspec.json.encode(self.body())


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, why: str) -> ApiError:
    """400 for a parameter the mesh does not implement (never silently ignored)."""
    return ApiError(
        400, f"{param}: {why} is not supported by meshd", param=param, code="unsupported_parameter"
    )


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """`Retry-After` (whole seconds, as HTTP requires) and OpenAI's `retry-after-ms`."""
    seconds = max(0.0, retry_after_s)
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(round(seconds * 1000)),
    }


def from_backend(exc: Overloaded | ServiceUnavailable) -> ApiError:
    """429 for `Overloaded`, 503 for `ServiceUnavailable`, both with `Retry-After`."""
    if isinstance(exc, Overloaded):
        return ApiError(
            429,
            f"the mesh is busy: {exc}; retry later",
            type=RATE_LIMIT,
            code="overloaded",
            headers=retry_headers(exc.retry_after_s),
        )
    return ApiError(
        503,
        f"the mesh cannot serve this request now: {exc.reason}",
        type=SERVER_ERROR,
        code="service_unavailable",
        headers=retry_headers(exc.retry_after_s),
    )


_AT = re.compile(r"\s*-\s*at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")
# A field msgspec names, as OpenAI words it: (what msgspec says, the message, the code).
_FIELD_ERRORS = (
    (_UNKNOWN, "Unrecognized request argument supplied", "unknown_parameter"),
    (_MISSING, "Missing required parameter", "missing_required_parameter"),
)


def from_validation(exc: msgspec.ValidationError) -> ApiError:
    """400 naming the offending parameter of a body msgspec refused."""
    text = str(exc)
    where = _AT.search(text)
    path = where.group("path").lstrip(".") if where else ""
    detail = text[: where.start()] if where else text
    for pattern, message, code in _FIELD_ERRORS:
        if found := pattern.match(detail):
            param = _join(path, found.group("field"))
            return ApiError(400, f"{message}: {param}", param=param, code=code)
    return ApiError(
        400,
        f"Invalid value for {path or 'the request body'}: {detail}",
        param=path or None,
        code="invalid_value",
    )


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field
