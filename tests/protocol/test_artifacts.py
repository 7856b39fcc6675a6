"""The artifact protocol: manifests checked against their id, bounded messages, and the fetch
state machine on a virtual clock (flow control, timeouts, resume after a lost source, a bad
hash fetched again elsewhere, failure when no source is left)."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from protocol import artifacts
from protocol.artifacts import (
    Artifact,
    ArtifactKind,
    ArtifactRefusal,
    ChunkReply,
    ChunkRequest,
    FetchConfig,
    Fetcher,
    Manifest,
    ManifestReply,
    SendRequest,
    VerifyArtifact,
    WriteChunk,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError

A, B = b"a" * 32, b"b" * 32
CHUNK = 1024


def _manifest(sizes: list[int]) -> tuple[Manifest, list[bytes]]:
    blobs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    arts = [
        Artifact(
            ArtifactKind.TENSOR, f"t{i}", len(b), hashlib.sha256(b).digest(), "F32", [len(b) // 4]
        )
        for i, b in enumerate(blobs)
    ]
    return Manifest(1, "safetensors", arts), blobs


def _fetcher(sizes: list[int], window: int = 4 * CHUNK, timeout_s: float = 1.0) -> Fetcher:
    manifest, _ = _manifest(sizes)
    config = FetchConfig(chunk_bytes=CHUNK, window_bytes=window, timeout_s=timeout_s)
    return Fetcher("0" * 32, manifest, range(len(sizes)), config)


def _requests(effects: list[artifacts.FetchEffect]) -> list[SendRequest]:
    return [e for e in effects if isinstance(e, SendRequest)]


def _answer(f: Fetcher, send: SendRequest, blobs: list[bytes]) -> list[artifacts.FetchEffect]:
    r = send.request
    data = blobs[r.index][r.offset : r.offset + r.length]
    return f.on_reply(send.source, ChunkReply(r.request_id, data))


def test_manifest_id_is_the_hash_of_its_bytes_and_a_wrong_manifest_is_refused() -> None:
    manifest, _ = _manifest([8, 16])
    data = artifacts.encode_manifest(manifest)
    model_id = artifacts.manifest_id(data)
    assert artifacts.open_manifest(data, model_id) == (model_id, manifest)
    assert artifacts.open_manifest(data, model_id[:8])[0] == model_id  # a prefix is enough
    other = artifacts.encode_manifest(_manifest([8, 17])[0])
    with pytest.raises(RemoteProtocolError, match="hashes to model"):
        artifacts.open_manifest(other, model_id)
    with pytest.raises(LocalProtocolError):  # not canonical: out of order
        artifacts.encode_manifest(Manifest(1, "safetensors", manifest.artifacts[::-1]))


def test_messages_round_trip_and_anything_out_of_bounds_is_a_remote_error() -> None:
    reply = ManifestReply(7, "a" * 32, b"x")
    assert artifacts.decode(artifacts.encode(reply)) == reply
    too_long = msgspec.msgpack.encode([3, 1, "a" * 32, 0, 0, artifacts.MAX_CHUNK_BYTES + 1])
    for bad in (b"\xc1", b"", too_long, msgspec.msgpack.encode([3, 1, "A" * 32, 0, 0, 1])):
        with pytest.raises(RemoteProtocolError):
            artifacts.decode(bad)
    with pytest.raises(RemoteProtocolError, match="too big"):
        artifacts.decode(b"\x00" * (artifacts.MAX_ARTIFACT_MESSAGE_BYTES + 1))


def test_requests_stay_within_each_sources_window_and_the_fetch_completes() -> None:
    f = _fetcher([10 * CHUNK, 3 * CHUNK + 5])
    _, blobs = _manifest([10 * CHUNK, 3 * CHUNK + 5])
    f.set_sources([A, B])
    now = 0.0
    written: dict[int, bytearray] = {0: bytearray(10 * CHUNK), 1: bytearray(3 * CHUNK + 5)}
    pending = _requests(f.poll(now))
    while not f.done:
        for source in (A, B):
            assert f._in_flight.get(source, 0) <= 4 * CHUNK
        assert pending, "stalled"
        send = pending.pop(0)
        for effect in _answer(f, send, blobs):
            if isinstance(effect, WriteChunk):
                written[effect.index][effect.offset : effect.offset + len(effect.data)] = (
                    effect.data
                )
            elif isinstance(effect, VerifyArtifact):
                ok = hashlib.sha256(written[effect.index]).digest() == (
                    f.manifest.artifacts[effect.index].sha256
                )
                f.on_verified(effect.index, ok)
        now += 0.01
        pending += _requests(f.poll(now))
    assert [bytes(written[i]) for i in (0, 1)] == blobs
    assert f.verified_bytes == f.total_bytes == f.received_bytes  # nothing fetched twice


def test_a_late_chunk_is_asked_again_after_the_timeout_from_another_source() -> None:
    f = _fetcher([CHUNK], timeout_s=1.0)
    f.set_sources([A, B])
    (first,) = _requests(f.poll(0.0))
    assert f.next_deadline() == 1.0
    assert _requests(f.poll(0.5)) == []
    (again,) = _requests(f.poll(1.0))
    assert again.request.offset == first.request.offset
    assert again.source != first.source  # the late source has a strike; the other has room
    # The late reply is ignored: the request it answers was given up.
    assert f.on_reply(first.source, ChunkReply(first.request.request_id, b"x" * CHUNK)) == []


def test_a_lost_source_resumes_elsewhere_from_what_arrived() -> None:
    sizes = [6 * CHUNK]
    f = _fetcher(sizes, window=2 * CHUNK)
    _, blobs = _manifest(sizes)
    f.set_sources([A, B])
    sent = _requests(f.poll(0.0))
    from_a = [s for s in sent if s.source == A]
    assert len(from_a) == 2 and len(sent) == 4
    _answer(f, from_a[0], blobs)  # one chunk from A arrived before its lane died
    f.on_source_lost(A)
    pending = [s for s in sent if s.source == B]
    asked_of_b: list[int] = [s.request.offset for s in pending]
    now = 0.0
    while pending:
        for s in pending:
            effects = _answer(f, s, blobs)
        now += 0.1
        pending = _requests(f.poll(now))
        assert all(s.source == B for s in pending)
        asked_of_b += [s.request.offset for s in pending]
    assert VerifyArtifact(0) in effects
    # Everything but the chunk that arrived from A was asked of B, once each.
    assert sorted(asked_of_b) == sorted(
        set(range(0, 6 * CHUNK, CHUNK)) - {from_a[0].request.offset}
    )


def test_bytes_that_do_not_match_are_fetched_again_from_another_source_or_fail() -> None:
    sizes = [2 * CHUNK]
    f = _fetcher(sizes)
    _, blobs = _manifest(sizes)
    f.set_sources([A, B])
    sent = _requests(f.poll(0.0))
    assert {s.source for s in sent} == {A, B}  # spread over both windows
    for s in sent:
        _answer(f, s, blobs)
    f.on_verified(0, False)  # a flipped byte somewhere: both supplied part of it
    assert f.failure() is None  # no culprit yet: next time the artifact comes from one source
    whole = _requests(f.poll(0.1))
    assert len({s.source for s in whole}) == 1
    for s in whole:
        _answer(f, s, blobs)
    f.on_verified(0, False)  # that source is bad; the other one comes next, alone
    (other,) = {A, B} - {whole[0].source}
    whole = _requests(f.poll(0.2))
    assert {s.source for s in whole} == {other}
    for s in whole:
        _answer(f, s, blobs)
    f.on_verified(0, False)  # both bad: nothing is left
    assert "refused it or sent bytes that do not match" in (f.failure() or "")

    f = _fetcher(sizes)
    f.set_sources([A])
    sent = _requests(f.poll(0.0))
    for s in sent:
        _answer(f, s, blobs)
    f.on_verified(0, False)  # A's bytes were wrong; B appears meanwhile
    f.set_sources([A, B])
    assert f.failure() is None
    again = _requests(f.poll(0.1))
    assert again and {s.source for s in again} == {B}
    for s in again:
        effects = _answer(f, s, blobs)
    assert VerifyArtifact(0) in effects
    f.on_verified(0, True)
    assert f.done


def test_refusals_move_to_the_next_source_and_fail_when_none_is_left() -> None:
    f = _fetcher([CHUNK])
    f.set_sources([A, B])
    (first,) = _requests(f.poll(0.0))
    f.on_reply(first.source, ArtifactRefusal(first.request.request_id, "not_held"))
    (second,) = _requests(f.poll(0.1))
    assert second.source != first.source
    f.on_reply(second.source, ArtifactRefusal(second.request.request_id, "not_held"))
    assert "t0" in (f.failure() or "")
    # A reply from a peer the request did not go to changes nothing.
    f2 = _fetcher([CHUNK])
    f2.set_sources([A])
    (req,) = _requests(f2.poll(0.0))
    assert f2.on_reply(B, ChunkReply(req.request.request_id, b"\0" * CHUNK)) == []


def test_without_any_source_the_fetch_waits_instead_of_failing() -> None:
    f = _fetcher([CHUNK])
    assert _requests(f.poll(0.0)) == [] and f.failure() is None
    f.set_sources([A])
    (req,) = _requests(f.poll(0.1))
    assert isinstance(req.request, ChunkRequest) and req.source == A


def test_a_retargeted_fetch_keeps_what_arrived_and_asks_nothing_twice() -> None:
    sizes = [4 * CHUNK, 4 * CHUNK, 4 * CHUNK]
    manifest, blobs = _manifest(sizes)
    config = FetchConfig(chunk_bytes=CHUNK, window_bytes=2 * CHUNK, timeout_s=1.0)
    f = Fetcher("0" * 32, manifest, [0, 1], config)  # the first plan's stage
    f.set_sources([A])
    asked: list[tuple[int, int]] = []
    first = _requests(f.poll(0.0))
    assert [s.request.index for s in first] == [0, 0]
    _answer(f, first[0], blobs)  # one chunk of artifact 0 arrived; the other is in flight
    # The plan moved: the stage now needs artifacts 1 and 2, no longer 0.
    f.retarget([1, 2])
    assert f.total_bytes == 8 * CHUNK and not f.wants(0)
    # The late reply for the dropped artifact is ignored.
    assert _answer(f, first[1], blobs) == []
    now, effects, verified = 0.0, [], []
    pending = _requests(f.poll(now))
    while not f.done:
        assert pending, "stalled"
        send = pending.pop(0)
        asked.append((send.request.index, send.request.offset))
        effects = _answer(f, send, blobs)
        for effect in effects:
            if isinstance(effect, VerifyArtifact):
                f.on_verified(effect.index, True)
                verified.append(effect.index)
        now += 0.01
        pending += _requests(f.poll(now))
    assert sorted(verified) == [1, 2]
    assert sorted(asked) == [(i, o) for i in (1, 2) for o in range(0, 4 * CHUNK, CHUNK)]
    # Retargeting back keeps the verified artifacts and their chunks: only 0 is asked.
    f.retarget([0, 1])
    assert f.wants(2) and f.total_bytes == 12 * CHUNK  # verified: kept
    again = _requests(f.poll(now + 0.1))
    assert {s.request.index for s in again} == {0}


def test_an_artifact_being_hashed_when_retargeted_away_is_kept_only_if_it_matches() -> None:
    sizes = [CHUNK, CHUNK, CHUNK]
    manifest, blobs = _manifest(sizes)
    f = Fetcher("0" * 32, manifest, [0, 1], FetchConfig(chunk_bytes=CHUNK, window_bytes=CHUNK))
    f.set_sources([A])
    sent = _requests(f.poll(0.0))
    (send0,) = [s for s in sent if s.request.index == 0]
    assert VerifyArtifact(0) in _answer(f, send0, blobs)
    f.retarget([2])  # 0 arrived whole and is being hashed; 1 has not
    assert f.wants(0) and not f.wants(1)
    f.on_verified(0, True)  # it matched: kept, not fetched again
    assert 0 in f.verified
    (send,) = _requests(f.poll(0.1))
    assert send.request.index == 2
    # A mismatch of an artifact no longer wanted drops it instead of fetching it again.
    g = Fetcher("0" * 32, manifest, [0], FetchConfig(chunk_bytes=CHUNK, window_bytes=CHUNK))
    g.set_sources([A])
    (send0,) = _requests(g.poll(0.0))
    _answer(g, send0, blobs)
    g.retarget([1])
    g.on_verified(0, False)
    assert not g.wants(0) and g.failure() is None and g.total_bytes == CHUNK
    (send,) = _requests(g.poll(0.1))
    assert send.request.index == 1


def test_a_holder_busy_for_minutes_is_waited_for_and_asked_until_it_answers() -> None:
    # The only holder is in view but answers nothing (hashing its file at first start, loading
    # its stage): the fetch says so, never gives up while it is listed, keeps asking it one
    # chunk at a time once it is struck out, and finishes when it answers.
    manifest, blobs = _manifest([4 * CHUNK])
    config = FetchConfig(
        chunk_bytes=CHUNK, window_bytes=2 * CHUNK, timeout_s=1.0, max_strikes=2, holder_wait_s=30.0
    )
    f = Fetcher("0" * 32, manifest, [0], config)
    f.set_sources([A])
    assert len(_requests(f.poll(0.0))) == 2 and f.wait(0.5) is None
    asked_late: list[SendRequest] = []
    now = 0.0
    while now < 120.0:  # four times holder_wait_s, in steps of a tenth of a second
        now = round(now + 0.1, 1)
        sent = _requests(f.poll(now))
        if now > 2 * config.timeout_s * config.max_strikes:
            assert len(sent) <= 1  # struck out: one chunk at a time
        asked_late += [s for s in sent if now > 100.0]
        wait = f.wait(now)
        if now >= config.timeout_s:
            assert wait is not None and wait.holders == (A,) and not wait.give_up
            assert wait.since == 0.0
            assert wait.reason(f.model_id, now).startswith(f"holder {A.hex()[:16]} alive but")
    assert asked_late and f.failure() is None
    # It answers: the fetch finishes, the wait ends.
    pending = asked_late[-1:]
    while not f.done:
        assert pending, "stalled"
        for effect in _answer(f, pending.pop(0), blobs):
            if isinstance(effect, VerifyArtifact):
                f.on_verified(effect.index, True)
        now += 0.01
        pending += _requests(f.poll(now))
        assert f.wait(now) is None
    assert f.verified_bytes == 4 * CHUNK


def test_with_no_holder_in_view_the_fetch_gives_up_after_holder_wait_s() -> None:
    manifest, _ = _manifest([CHUNK])
    config = FetchConfig(chunk_bytes=CHUNK, window_bytes=CHUNK, timeout_s=1.0, holder_wait_s=20.0)
    f = Fetcher("0" * 32, manifest, [0], config)
    f.poll(5.0)  # no member holding the model is in view yet
    wait = f.wait(15.0)
    assert wait is not None and wait.holders == () and not wait.give_up
    assert (
        wait.reason(f.model_id, 15.0)
        == "no member holding model 0000000000000000 is in view for 10 s"
    )
    # A holder appears and leaves again: the wait counts from when it left.
    f.set_sources([A])
    f.poll(16.0)
    f.on_source_lost(A)
    f.poll(17.0)
    assert not f.wait(36.9).give_up  # type: ignore[union-attr]
    wait = f.wait(37.0)
    assert wait is not None and wait.give_up and wait.since == 17.0
