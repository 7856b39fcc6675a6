import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import LocalProtocolError, RemoteProtocolError
from protocol.messages import (
    MAX_DROP_ENTRIES,
    MAX_KEEPALIVE_SESSIONS,
    CloseSession,
    DropEntries,
    OpenSession,
    Rollback,
    Sampling,
    SessionKeepAlive,
    StageError,
    StageHidden,
    StageTiming,
    TensorBlob,
    VerifyReply,
    VerifyWindow,
    decode,
    encode,
)

WINDOW = VerifyWindow(
    session="s1",
    epoch=2,
    window_id=7,
    base_pos=100,
    tokens=[5, 6, 7],
    sampling=Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=1),
    n_draft=2,
)
EXAMPLES = [
    WINDOW,
    OpenSession(
        session="s1", model_id="m", max_positions=512, stage_index=1, coordinator=b"k" * 32
    ),
    CloseSession(session="s1"),
    Rollback(session="s1", epoch=3),
    StageHidden(
        window=WINDOW,
        hidden=TensorBlob("f16", (3, 4), bytes(24)),
        timings=[StageTiming(0, 0.001, 0.002)],
    ),
    VerifyReply(
        session="s1",
        window_id=7,
        epoch=2,
        accepted_len=1,
        next_token=9,
        mtp_draft=[1, 2],
        stage_timings=[StageTiming(1, 0.0, 0.003)],
    ),
    StageError(session="s1", code="kv_budget", message="no room"),
    SessionKeepAlive(sessions=["s1", "s2"]),
    OpenSession(
        session="s2",
        model_id="m",
        max_positions=512,
        stage_index=0,
        coordinator=b"k" * 32,
        prefix_entry=2**63 - 1,
        prefix_positions=256,
    ),
    CloseSession(session="s2", keep_entry=9, keep_positions=300, replaces=4),
    DropEntries(entries=[1, 2**63 - 1, 77]),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: object) -> None:
    assert decode(encode(message)) == message  # type: ignore[arg-type]


def test_keep_alive_limits_are_enforced() -> None:
    full = SessionKeepAlive([f"s{i}" for i in range(MAX_KEEPALIVE_SESSIONS)])
    assert decode(encode(full)) == full
    for bad in (
        SessionKeepAlive([*full.sessions, "one-more"]),
        SessionKeepAlive(["ok", ""]),
        SessionKeepAlive(["x" * 65]),
    ):
        with pytest.raises(LocalProtocolError):
            encode(bad)
        raw = msgspec.msgpack.encode(bad)
        with pytest.raises(RemoteProtocolError):
            decode(raw)


def test_prefix_cache_fields_are_checked() -> None:
    base = OpenSession(session="s", model_id="m", max_positions=64, stage_index=0, coordinator=b"")
    for bad in (
        msgspec.structs.replace(base, prefix_entry=3),  # an entry needs positions
        msgspec.structs.replace(base, prefix_positions=3),  # positions need an entry
        msgspec.structs.replace(base, prefix_entry=-1, prefix_positions=3),
        msgspec.structs.replace(base, prefix_entry=3, prefix_positions=64),  # nothing left
        CloseSession("s", keep_entry=2**63, keep_positions=3),
        CloseSession("s", keep_entry=5),
        CloseSession("s", replaces=-2),
    ):
        with pytest.raises(LocalProtocolError):
            encode(bad)
        with pytest.raises(RemoteProtocolError):
            decode(msgspec.msgpack.encode(bad))


def test_drop_entries_names_1_to_1024_valid_ids() -> None:
    full = DropEntries(list(range(1, MAX_DROP_ENTRIES + 1)))
    assert decode(encode(full)) == full
    for bad in (
        DropEntries([]),
        DropEntries([*full.entries, MAX_DROP_ENTRIES + 1]),
        DropEntries([5, 0]),  # 0 means "no entry": never one to drop
        DropEntries([-3]),
        DropEntries([2**63]),
    ):
        with pytest.raises(LocalProtocolError):
            encode(bad)
        with pytest.raises(RemoteProtocolError):
            decode(msgspec.msgpack.encode(bad))


def test_reply_keeps_target_token_and_mtp_draft_apart() -> None:
    reply = decode(encode(EXAMPLES[5]))  # type: ignore[arg-type]
    assert isinstance(reply, VerifyReply)
    assert reply.next_token == 9 and reply.mtp_draft == [1, 2]


def test_tensor_byte_count_must_match_shape() -> None:
    bad = StageHidden(window=WINDOW, hidden=TensorBlob("f32", (3, 4), bytes(24)), timings=[])
    with pytest.raises(LocalProtocolError):
        encode(bad)


def test_hidden_rows_must_match_window_tokens() -> None:
    bad = StageHidden(window=WINDOW, hidden=TensorBlob("f32", (2, 1), bytes(8)), timings=[])
    with pytest.raises(LocalProtocolError):
        encode(bad)


@pytest.mark.parametrize(
    "field,value",
    [("n_draft", 3), ("tokens", []), ("base_pos", -1), ("tokens", [1, -2]), ("session", "")],
)
def test_window_limits_are_enforced(field: str, value: object) -> None:
    import msgspec

    with pytest.raises(LocalProtocolError):
        encode(msgspec.structs.replace(WINDOW, **{field: value}))


@given(st.binary(max_size=300))
def test_garbage_raises_only_remote_protocol_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode(data)


@given(st.data())
def test_mutated_messages_raise_only_remote_protocol_error(data: st.DataObject) -> None:
    raw = bytearray(encode(data.draw(st.sampled_from(EXAMPLES))))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(RemoteProtocolError):
        decode(bytes(raw))
