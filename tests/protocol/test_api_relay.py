"""Relayed API messages round-trip, and the limits hold both ways."""

from __future__ import annotations

import pytest

from protocol import api_relay
from protocol.api_relay import ApiBody, ApiCancel, ApiEnd, ApiHead, ApiRequest
from protocol.errors import LocalProtocolError, RemoteProtocolError


def test_messages_round_trip() -> None:
    for message in (
        ApiRequest(1, "POST", "/v1/completions", b'{"model": "m"}'),
        ApiHead(1, 200, [("content-type", "text/event-stream")]),
        ApiBody(1, b"data: {}\n\n"),
        ApiEnd(1, ""),
        ApiEnd(1, "cut"),
        ApiCancel(1),
    ):
        assert api_relay.decode(api_relay.encode(message)) == message


def test_limits_are_enforced_on_both_sides() -> None:
    too_big = ApiBody(1, b"x" * (api_relay.MAX_BODY_CHUNK_BYTES + 1))
    with pytest.raises(LocalProtocolError):
        api_relay.encode(too_big)
    with pytest.raises(RemoteProtocolError):
        api_relay.decode(b"\x93garbage")
    with pytest.raises(RemoteProtocolError):
        api_relay.decode(api_relay._encoder.encode(too_big))
