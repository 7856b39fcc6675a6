"""API requests relayed over a lane (`API_STREAM`): a node asked for a model it does not hold
passes the HTTP request to a node that holds it and streams the answer back.

    asker → holder   ApiRequest(request, method, path, body)
    holder → asker   ApiHead(request, status, headers), then ApiBody(request, data)...,
                     then ApiEnd(request, error)
    asker → holder   ApiCancel(request): the client went away; stop generating.

Bodies are the HTTP bytes as the holder's own API answers them (OpenAI JSON or server-sent
events), so the asker forwards them unchanged. Sans-IO: encode/decode and limits only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.errors import LocalProtocolError, RemoteProtocolError

# One relayed request body at most (the API's own limit is smaller by default).
MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# One relayed chunk of response at most; larger answers travel in several.
MAX_BODY_CHUNK_BYTES = 256 * 1024
MAX_API_MESSAGE_BYTES = MAX_REQUEST_BODY_BYTES + 4096
MAX_PATH_CHARS = 256
MAX_HEADERS = 32
MAX_HEADER_CHARS = 1024
MAX_ERROR_CHARS = 512

RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Header = tuple[
    Annotated[str, msgspec.Meta(max_length=MAX_HEADER_CHARS)],
    Annotated[str, msgspec.Meta(max_length=MAX_HEADER_CHARS)],
]


class ApiRequest(msgspec.Struct, frozen=True, tag="request"):
    """Asker → holder: run this API request (already authenticated by the asker)."""

    request: RequestId
    method: Annotated[str, msgspec.Meta(max_length=16)]
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    body: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUEST_BODY_BYTES)]


class ApiHead(msgspec.Struct, frozen=True, tag="head"):
    """Holder → asker: the response's status and headers."""

    request: RequestId
    status: Annotated[int, msgspec.Meta(ge=100, le=599)]
    headers: Annotated[list[Header], msgspec.Meta(max_length=MAX_HEADERS)]


class ApiBody(msgspec.Struct, frozen=True, tag="body"):
    """Holder → asker: the next bytes of the response body."""

    request: RequestId
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_BODY_CHUNK_BYTES)]


class ApiEnd(msgspec.Struct, frozen=True, tag="end"):
    """Holder → asker: the response is complete ("" error) or was cut (why)."""

    request: RequestId
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""


class ApiCancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Asker → holder: the client is gone; stop the request."""

    request: RequestId


ApiMessage = ApiRequest | ApiHead | ApiBody | ApiEnd | ApiCancel

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ApiMessage)


def encode(message: ApiMessage) -> bytes:
    """Encode one message; LocalProtocolError if it breaks a limit (our bug)."""
    data = _encoder.encode(message)
    if len(data) > MAX_API_MESSAGE_BYTES:
        raise LocalProtocolError(f"api message of {len(data)} bytes exceeds the limit")
    try:
        _decoder.decode(data)  # the same limits the receiver enforces
    except msgspec.ValidationError as exc:
        raise LocalProtocolError(f"api message breaks a limit: {exc}") from None
    return data


def decode(data: bytes) -> ApiMessage:
    """Decode one message; anything malformed raises RemoteProtocolError."""
    if len(data) > MAX_API_MESSAGE_BYTES:
        raise RemoteProtocolError(f"api message of {len(data)} bytes exceeds the limit")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed api message: {exc}") from None
