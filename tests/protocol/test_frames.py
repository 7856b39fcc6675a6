"""Frame codecs: round trips, and remote garbage raises only RemoteProtocolError."""

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.frames import (
    ALL_STREAMS,
    AckFrame,
    CloseFrame,
    MaxDataFrame,
    MaxStreamDataFrame,
    PaddingFrame,
    PingFrame,
    StreamFrame,
    decode_ack,
    decode_close,
    decode_frames,
    decode_max_data,
    decode_max_stream_data,
    decode_stream,
    encode_ack,
    encode_close,
    encode_max_data,
    encode_max_stream_data,
    encode_stream_header,
)


def test_every_frame_round_trips_in_one_payload() -> None:
    payload = b"".join(
        [
            encode_ack([(10, 12), (3, 5)], 0.0025),
            encode_stream_header(7, 1 << 40, 5) + b"hello",
            encode_max_data(123456),
            encode_max_stream_data(ALL_STREAMS, 99),
            encode_close(1, "bye \N{SNOWMAN}"),
            b"\x01",
            b"\x00" * 9,
        ]
    )
    assert decode_frames(payload) == [
        AckFrame(0.0025, ((10, 12), (3, 5))),
        StreamFrame(7, 1 << 40, b"hello"),
        MaxDataFrame(123456),
        MaxStreamDataFrame(ALL_STREAMS, 99),
        CloseFrame(1, "bye \N{SNOWMAN}"),
        PingFrame(),
        PaddingFrame(9),
    ]


def test_close_reason_is_cut_on_a_character_boundary() -> None:
    frame, _ = decode_close(encode_close(0, "\N{SNOWMAN}" * 1000), 0)
    assert frame.reason == "\N{SNOWMAN}" * 341  # 1024 bytes hold 341 three-byte characters


@pytest.mark.parametrize(
    "ranges",
    [[], [(5, 5)], [(3, 5), (6, 9)], [(3, 5), (5, 9)], [(3, 5), (1, 3)]],
    ids=["none", "empty", "ascending", "overlapping", "adjacent"],
)
def test_ack_frames_with_bad_ranges_are_refused(ranges: list[tuple[int, int]]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_ack(encode_ack(ranges, 0.0), 0)


def test_truncated_frames_are_refused() -> None:
    samples = [
        encode_ack([(1, 2)], 0.0),
        encode_stream_header(1, 0, 4) + b"abcd",
        encode_max_data(5),
        encode_max_stream_data(1, 5),
        encode_close(0, "why"),
    ]
    for sample in samples:
        for cut in range(1, len(sample)):
            with pytest.raises(RemoteProtocolError):
                decode_frames(sample[:cut])


DECODERS = [decode_ack, decode_stream, decode_max_data, decode_max_stream_data, decode_close]


@settings(max_examples=300)
@given(st.binary(max_size=80), st.sampled_from(DECODERS))
def test_each_decoder_raises_only_remote_errors(data: bytes, decoder: object) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decoder(data, 0)  # type: ignore[operator]


@settings(max_examples=300)
@given(st.binary(max_size=120))
def test_decode_frames_raises_only_remote_errors(data: bytes) -> None:
    try:
        frames = decode_frames(data)
    except RemoteProtocolError:
        return
    assert frames


@settings(max_examples=200)
@given(st.data())
def test_mutated_valid_payloads_raise_only_remote_errors(data: st.DataObject) -> None:
    payload = bytearray(
        encode_ack([(10, 12)], 0.001)
        + encode_stream_header(1, 0, 3)
        + b"abc"
        + encode_close(0, "x")
    )
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(RemoteProtocolError):
        decode_frames(bytes(payload))
