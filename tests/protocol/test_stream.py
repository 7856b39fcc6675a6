"""Streams: messages survive any chunking, order, overlap and duplication, exactly once."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.stream import RecvStream, SendStream, StreamChunk


def drain(send: SendStream, budget: int) -> list[StreamChunk]:
    chunks = []
    while (chunk := send.take_new(budget)) is not None:
        chunks.append(chunk)
    return chunks


def payload(chunk: StreamChunk) -> bytes:
    return b"".join(bytes(p) for p in chunk.pieces)


@settings(max_examples=60)
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=12),
    st.integers(1, 200),
    st.randoms(use_true_random=False),
)
def test_messages_arrive_whole_in_order_once_under_shuffle_and_duplicates(
    messages: list[bytes], budget: int, rng: random.Random
) -> None:
    send = SendStream(3, max_stream_data=1 << 30)
    for message in messages:
        send.queue_message(message)
    chunks = drain(send, budget)
    wire = b"".join(payload(c) for c in chunks)
    deliveries = [(c.offset, payload(c)) for c in chunks]
    deliveries += [(c.offset, payload(c)) for c in rng.sample(chunks, k=len(chunks) // 2)]
    for _ in range(len(chunks)):
        # Overlapping copies cut at other boundaries, as a resplit retransmission would be.
        start = rng.randrange(len(wire))
        deliveries.append((start, wire[start : start + rng.randrange(1, 2 * budget + 2)]))
    rng.shuffle(deliveries)
    recv = RecvStream(3, window=1 << 30, max_message_bytes=1000)
    got: list[bytes] = []
    for offset, data in deliveries:
        got.extend(recv.receive(offset, data))
    assert got == messages


def test_split_retransmission_fits_a_smaller_budget_and_skips_acked_bytes() -> None:
    send = SendStream(1, max_stream_data=1 << 20)
    send.queue_message(b"a" * 100)
    (chunk,) = drain(send, 1000)
    send.on_lost(chunk)
    first = send.take_retransmit(40)
    assert first is not None and (first.offset, first.length) == (0, 40)
    rest = send.take_retransmit(1000)
    assert rest is not None and (rest.offset, rest.length) == (40, 64)
    assert payload(first) + payload(rest) == payload(chunk)
    assert send.on_acked(first) == 40 and send.on_acked(chunk) == 64
    send.on_lost(rest)  # already acked through the other copy: nothing to resend
    assert send.take_retransmit(1000) is None and send.unacked_bytes == 0


def test_sender_respects_stream_credit() -> None:
    send = SendStream(1, max_stream_data=10)
    send.queue_message(b"x" * 50)
    assert sum(c.length for c in drain(send, 1000)) == 10
    assert send.blocked_on_credit()
    send.max_stream_data = 54
    assert sum(c.length for c in drain(send, 1000)) == 44


def test_receiver_refuses_bytes_beyond_its_credit() -> None:
    recv = RecvStream(1, window=100, max_message_bytes=1000)
    with pytest.raises(RemoteProtocolError, match="flow control"):
        recv.receive(90, b"x" * 11)


def test_receiver_refuses_an_oversized_message_as_soon_as_its_header_arrives() -> None:
    recv = RecvStream(1, window=1 << 20, max_message_bytes=1000)
    with pytest.raises(RemoteProtocolError, match="exceeds 1000"):
        recv.receive(0, (1001).to_bytes(4, "big"))


def test_credit_grows_as_bytes_are_consumed() -> None:
    recv = RecvStream(1, window=100, max_message_bytes=1000)
    recv.receive(0, (200).to_bytes(4, "big") + b"x" * 40)
    assert recv.credit_update() is None  # 44 of 100 consumed: not yet half
    recv.receive(44, b"x" * 20)
    assert recv.credit_update() == 164
    # A message larger than the window still completes as credit keeps coming.
    recv.receive(64, b"x" * 100)
    assert recv.credit_update() == 264
    assert recv.receive(164, b"x" * 40) == [b"x" * 200]
