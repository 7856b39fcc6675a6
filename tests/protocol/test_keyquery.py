import contextlib
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import RemoteProtocolError
from protocol.keyquery import answer_query, make_query, query_key, read_answer

MESH = query_key(b"\x01" * 32)
OTHER = query_key(b"\x02" * 32)
PUB = bytes(range(32))


def test_member_learns_the_key_and_the_answer_is_no_larger_than_the_query() -> None:
    nonce = os.urandom(16)
    query = make_query(MESH, nonce)
    answer = answer_query(MESH, query, PUB)
    assert len(answer) <= len(query)
    assert read_answer(MESH, answer) == (nonce, PUB)


def test_outsiders_can_neither_ask_nor_answer() -> None:
    with pytest.raises(RemoteProtocolError):
        answer_query(MESH, make_query(OTHER, os.urandom(16)), PUB)
    forged = answer_query(OTHER, make_query(OTHER, os.urandom(16)), b"\xee" * 32)
    with pytest.raises(RemoteProtocolError):
        read_answer(MESH, forged)


def test_a_tampered_answer_is_rejected() -> None:
    answer = bytearray(answer_query(MESH, make_query(MESH, os.urandom(16)), PUB))
    answer[30] ^= 1  # inside the key
    with pytest.raises(RemoteProtocolError):
        read_answer(MESH, bytes(answer))


@given(st.binary(max_size=100))
def test_garbage_raises_only_remote_protocol_error(data: bytes) -> None:
    for call in (lambda: answer_query(MESH, data, PUB), lambda: read_answer(MESH, data)):
        with contextlib.suppress(RemoteProtocolError):
            call()
