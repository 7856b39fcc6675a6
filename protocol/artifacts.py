"""Model artifacts over lanes: the manifest a model id names, and fetching its bytes by chunk.

A model's **manifest** lists every artifact a node needs to serve it: its small files
(`config.json`, tokenizer files) and each tensor the runtime reads, each with its size and
SHA-256 (tensors also with dtype and shape). The model id *is* the hash of the manifest's
canonical encoding (`manifest_id`), so a node that knows the id can check a manifest from an
untrusted peer, and through it every byte it fetches: a peer cannot feed it other weights.

Messages travel on `ARTIFACT_STREAM`, a `msgspec` tagged union like `protocol.gossip`:
`ManifestRequest` → `ManifestReply`, and `ChunkRequest` → `ChunkReply`, or `ArtifactRefusal`
when the peer does not hold what was asked (it answers only from files it actually holds).
`decode` bounds everything: a peer is untrusted.

`Fetcher` is the sans-IO state machine of one node's fetch: which chunks are wanted, which
requests are outstanding within a per-source flow-control window (so bulk bytes never crowd a
lane: gossip and verify windows share it), timeouts, resuming from another source after a lane
dies, and what a failed verification means (the artifact is fetched again, from a source that
did not supply the bad bytes). The driver hashes a completed artifact and reports the outcome.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.gossip import MAX_MODEL_NAME_CHARS

MANIFEST_VERSION = 1
# Domain separation: a manifest hash is never any other hash of the same bytes.
MANIFEST_ID_CONTEXT = b"meshd/model-manifest/v1\x00"
MODEL_ID_CHARS = 32  # hex: 128 bits of the manifest's SHA-256
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
MAX_ARTIFACTS = 65536
MAX_NAME_CHARS = 256
MAX_DIMS = 8
# One chunk reply carries at most this many bytes (a lane message may be up to 16 MiB).
MAX_CHUNK_BYTES = 4 * 1024 * 1024
MAX_DETAIL_CHARS = 256
MAX_U63 = (1 << 63) - 1
MAX_ARTIFACT_MESSAGE_BYTES = MAX_MANIFEST_BYTES + 1024

U32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_U63)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Sha256 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
ModelId = Annotated[
    str, msgspec.Meta(min_length=MODEL_ID_CHARS, max_length=MODEL_ID_CHARS, pattern="^[0-9a-f]+$")
]
IdPrefix = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MODEL_ID_CHARS, pattern="^[0-9a-f]+$")
]


class ArtifactKind(enum.IntEnum):
    """A small file stored as-is, or one tensor's raw bytes."""

    FILE = 0
    TENSOR = 1


class Artifact(msgspec.Struct, frozen=True, array_like=True):
    """One file or tensor of a model: its bytes' length and SHA-256 (tensors: dtype, shape)."""

    kind: ArtifactKind
    name: Name
    nbytes: U63
    sha256: Sha256
    dtype: Annotated[str, msgspec.Meta(max_length=16)] = ""
    shape: Annotated[list[U63], msgspec.Meta(max_length=MAX_DIMS)] = []


class Manifest(msgspec.Struct, frozen=True, array_like=True):
    """Everything a node needs to serve a model, in canonical order (files, then tensors,
    each by name). `format` names how the holder stores it (`safetensors`)."""

    version: int
    format: Annotated[str, msgspec.Meta(max_length=32)]
    artifacts: Annotated[list[Artifact], msgspec.Meta(max_length=MAX_ARTIFACTS)]

    def index_of(self, name: str, kind: ArtifactKind) -> int | None:
        """The artifact's index by kind and name (None: not in the manifest)."""
        for i, artifact in enumerate(self.artifacts):
            if artifact.kind == kind and artifact.name == name:
                return i
        return None


class ManifestRequest(msgspec.Struct, frozen=True, array_like=True, tag=1):
    """Ask for the manifest of the model whose id starts with `model_prefix`."""

    request_id: U32
    model_prefix: IdPrefix


class ManifestReply(msgspec.Struct, frozen=True, array_like=True, tag=2):
    """The manifest's canonical bytes; the asker checks they hash to `model_id`."""

    request_id: U32
    model_id: ModelId
    manifest: Annotated[bytes, msgspec.Meta(max_length=MAX_MANIFEST_BYTES)]
    # What the holder's API calls the model (not part of the id: a name is no weight data),
    # so that a node fetching it answers to the same name.
    name: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME_CHARS)] = ""


class ChunkRequest(msgspec.Struct, frozen=True, array_like=True, tag=3):
    """Ask for bytes [offset, offset + length) of artifact `index` of `model_id`'s manifest."""

    request_id: U32
    model_id: ModelId
    index: U32
    offset: U63
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_BYTES)]


class ChunkReply(msgspec.Struct, frozen=True, array_like=True, tag=4):
    """The bytes a `ChunkRequest` asked for (exactly `length` of them)."""

    request_id: U32
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_CHUNK_BYTES)]


RefusalCode = Literal["unknown_model", "not_held", "bad_range", "unreadable"]


class ArtifactRefusal(msgspec.Struct, frozen=True, array_like=True, tag=5):
    """The peer does not serve what a request asked for (and says why)."""

    request_id: U32
    code: RefusalCode
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] = ""


ArtifactMessage = ManifestRequest | ManifestReply | ChunkRequest | ChunkReply | ArtifactRefusal

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ArtifactMessage)
_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


def encode(message: ArtifactMessage) -> bytes:
    """Encode one message on the artifact stream."""
    return _encoder.encode(message)


def decode(data: bytes) -> ArtifactMessage:
    """Decode and validate one message; anything malformed raises RemoteProtocolError."""
    if len(data) > MAX_ARTIFACT_MESSAGE_BYTES:
        raise RemoteProtocolError(f"artifact message of {len(data)} bytes is too big")
    try:
        message: ArtifactMessage = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed artifact message: {exc}") from None
    return message


def encode_manifest(manifest: Manifest) -> bytes:
    """The canonical bytes of `manifest` (artifacts must be in canonical order)."""
    keys = [(a.kind, a.name) for a in manifest.artifacts]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise LocalProtocolError("manifest artifacts must be unique and sorted by kind and name")
    data = _encoder.encode(manifest)
    if len(data) > MAX_MANIFEST_BYTES:
        raise LocalProtocolError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    return data


def manifest_id(data: bytes) -> str:
    """The model id of a manifest's canonical bytes."""
    return hashlib.sha256(MANIFEST_ID_CONTEXT + data).hexdigest()[:MODEL_ID_CHARS]


def open_manifest(data: bytes, expected: str) -> tuple[str, Manifest]:
    """Check that `data` hashes to a model id starting with `expected` (a full id or a
    prefix) and decode it: (model id, manifest). RemoteProtocolError otherwise."""
    model_id = manifest_id(data)
    if not expected or not model_id.startswith(expected):
        raise RemoteProtocolError(
            f"manifest hashes to model {model_id}, not the {expected!r} that was asked for"
        )
    try:
        manifest = _manifest_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed manifest: {exc}") from None
    if manifest.version != MANIFEST_VERSION:
        raise RemoteProtocolError(f"manifest version {manifest.version} is not supported")
    return model_id, manifest


# ---- the fetch state machine ---------------------------------------------------------------


class FetchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a fetch paces itself, and how long it waits for a holder (the daemon's `[fetch]`
    table). Validated on construction (ValueError naming the field).

    `window_bytes` bounds the bytes requested and not yet received from one source: the flow
    control that keeps a bulk transfer from filling a lane's queues ahead of gossip and verify
    windows. `timeout_s` re-requests a chunk that did not arrive (from another source if
    there is one); a source that times out `max_strikes` times in a row is asked only one
    chunk at a time until it answers: it may be busy (hashing or loading its file), not gone.
    While a source is listed the fetch waits for it; with none listed for `holder_wait_s`, it
    gives up (`Fetcher.wait`).
    """

    chunk_bytes: int = 256 * 1024
    window_bytes: int = 1024 * 1024
    timeout_s: float = 10.0
    max_strikes: int = 3
    holder_wait_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        if self.window_bytes < self.chunk_bytes:
            raise ValueError("window_bytes must be at least chunk_bytes")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.max_strikes < 1:
            raise ValueError("max_strikes must be >= 1")
        if not self.holder_wait_s > 0:
            raise ValueError("holder_wait_s must be > 0")


@dataclass(frozen=True, slots=True)
class SendRequest:
    """Send `request` to the source `source` (a lane key)."""

    source: bytes
    request: ChunkRequest


@dataclass(frozen=True, slots=True)
class WriteChunk:
    """Store `data` at `offset` of artifact `index` (it is not verified yet)."""

    index: int
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class VerifyArtifact:
    """Every byte of artifact `index` arrived: hash it and call `on_verified`."""

    index: int


FetchEffect = SendRequest | WriteChunk | VerifyArtifact


@dataclass(frozen=True, slots=True)
class FetchWait:
    """Why a fetch is not receiving now (`Fetcher.wait`): no source is listed (`holders`
    empty), or the listed ones do not answer; since when (`since`, the caller's clock), and
    whether it is time to give up (`give_up`: no source listed for `holder_wait_s`)."""

    holders: tuple[bytes, ...]
    since: float
    give_up: bool

    def reason(self, model_id: str, now: float) -> str:
        """One line for the log and `meshctl status`."""
        waited = now - self.since
        if not self.holders:
            return f"no member holding model {model_id[:16]} is in view for {waited:.0f} s"
        names = ", ".join(h.hex()[:16] for h in self.holders)
        return (
            f"holder {names} alive but not answering for {waited:.0f} s "
            "(still hashing or loading its file?)"
        )


@dataclass(slots=True)
class _Pending:
    source: bytes
    index: int
    offset: int
    length: int
    sent_at: float


@dataclass(slots=True)
class _Wanted:
    missing: list[tuple[int, int]]  # (offset, length) chunks not yet asked for, or re-queued
    received: int = 0
    contributors: set[bytes] = field(default_factory=set)
    excluded: set[bytes] = field(default_factory=set)  # refused or supplied bad bytes
    # After bytes from several sources did not match, the artifact comes whole from one
    # source (`pinned`), preferring none of the `suspects`, so the next mismatch names a culprit.
    single: bool = False
    pinned: bytes | None = None
    suspects: set[bytes] = field(default_factory=set)


class FetchFailed(Exception):
    """An artifact has no source left: every holder refused it or supplied wrong bytes."""


class Fetcher:
    """Fetch artifacts of one manifest from several sources, chunk by chunk (sans-IO)."""

    def __init__(
        self,
        model_id: str,
        manifest: Manifest,
        wanted: Iterable[int],
        config: FetchConfig | None = None,
        *,
        first_request_id: int = 1,
    ) -> None:
        self.model_id = model_id
        self.manifest = manifest
        self.config = config or FetchConfig()
        self._wanted: dict[int, _Wanted] = {}
        for index in dict.fromkeys(wanted):  # asked in this order (the most wanted first)
            self._wanted[index] = _Wanted(missing=self._chunks(index))
        self.total_bytes = sum(manifest.artifacts[i].nbytes for i in self._wanted)
        self.verified_bytes = 0
        self.received_bytes = 0  # every byte that arrived, re-fetches included
        self.verified: set[int] = set()
        self.failed: dict[int, str] = {}
        self._sources: list[bytes] = []
        self._strikes: dict[bytes, int] = {}
        self._pending: dict[int, _Pending] = {}
        self._in_flight: dict[bytes, int] = {}
        self._next_id = first_request_id
        self._verifying: set[int] = set()
        # Artifacts `retarget` dropped while they were being hashed: kept if they match.
        self._leaving: set[int] = set()
        # Empty artifacts (nothing to fetch) are verified by hashing nothing.
        self._empty = [i for i, w in self._wanted.items() if not w.missing]
        # What `wait` reads, kept by `poll`: when bytes last arrived (or the fetch began), and
        # since when no source has been listed.
        self._seen_bytes = -1
        self._progress_at = 0.0
        self._sourceless_since: float | None = None

    def _chunks(self, index: int) -> list[tuple[int, int]]:
        """Artifact `index`'s chunks, last first (they are popped from the end)."""
        nbytes = self.manifest.artifacts[index].nbytes
        step = self.config.chunk_bytes
        return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)][::-1]

    # -- what the driver reads ------------------------------------------------------------
    def wants(self, index: int) -> bool:
        """Whether artifact `index` is (still) part of this fetch."""
        return index in self._wanted

    @property
    def done(self) -> bool:
        """Every wanted artifact is verified."""
        return len(self.verified) == len(self._wanted)

    @property
    def outstanding_bytes(self) -> int:
        """Bytes requested and not yet received, over every source."""
        return sum(self._in_flight.values())

    def wait(self, now: float) -> FetchWait | None:
        """Why nothing arrives now (None: bytes arrived within `timeout_s`, or it is done).

        With no source listed it gives up after `holder_wait_s`; while a source is listed it
        never does: a member holding the model that is alive in the view but does not answer
        is busy (hashing its file at first start, loading a stage), and is asked again.
        """
        if self.done:
            return None
        if self._sourceless_since is not None:
            waited = now - self._sourceless_since
            give_up = waited >= self.config.holder_wait_s
            return FetchWait((), self._sourceless_since, give_up)
        if now - self._progress_at < self.config.timeout_s:
            return None
        return FetchWait(tuple(self._sources), self._progress_at, False)

    def next_deadline(self) -> float | None:
        """When the oldest outstanding request times out (None: nothing outstanding)."""
        if not self._pending:
            return None
        return min(p.sent_at for p in self._pending.values()) + self.config.timeout_s

    # -- inputs ---------------------------------------------------------------------------
    def set_sources(self, sources: Sequence[bytes]) -> None:
        """The peers that may hold the artifacts, best first (a fresh list forgives strikes)."""
        self._sources = list(dict.fromkeys(sources))
        self._strikes = {s: n for s, n in self._strikes.items() if s in self._sources}
        for source in self._sources:
            self._strikes.setdefault(source, 0)
        for index in list(self.failed):  # a new holder may supply what failed
            if any(s not in self._wanted[index].excluded for s in self._sources):
                del self.failed[index]

    def poll(self, now: float) -> list[FetchEffect]:
        """Time out late requests and issue new ones within each source's window."""
        effects: list[FetchEffect] = [VerifyArtifact(i) for i in self._empty]
        for i in self._empty:
            self._verifying.add(i)
        self._empty = []
        if self.received_bytes != self._seen_bytes:
            self._seen_bytes, self._progress_at = self.received_bytes, now
        if self._sources:
            self._sourceless_since = None
        elif self._sourceless_since is None:
            self._sourceless_since = now
        for request_id, p in list(self._pending.items()):
            if now - p.sent_at >= self.config.timeout_s:
                self._drop(request_id)
                self._strikes[p.source] = self._strikes.get(p.source, 0) + 1
        self._check_failed()
        for index, wanted in self._wanted.items():
            while wanted.missing:
                source = self._pick(index, wanted)
                if source is None:
                    break
                offset, length = wanted.missing.pop()
                request_id = self._next_id
                self._next_id = (self._next_id % 0xFFFFFFFF) + 1
                self._pending[request_id] = _Pending(source, index, offset, length, now)
                self._in_flight[source] = self._in_flight.get(source, 0) + length
                effects.append(
                    SendRequest(
                        source,
                        ChunkRequest(request_id, self.model_id, index, offset, length),
                    )
                )
        return effects

    def on_reply(self, source: bytes, reply: ChunkReply | ArtifactRefusal) -> list[FetchEffect]:
        """A chunk (or a refusal) arrived from `source`. Replies to requests this fetcher
        did not send to `source`, or no longer waits for, are ignored."""
        p = self._pending.get(reply.request_id)
        if p is None or p.source != source:
            return []
        wanted = self._wanted[p.index]
        self._drop(reply.request_id, requeue=False)
        if isinstance(reply, ArtifactRefusal) or len(reply.data) != p.length:
            wanted.missing.append((p.offset, p.length))
            wanted.excluded.add(source)
            self._check_failed()
            return []
        self._strikes[source] = 0
        wanted.received += p.length
        wanted.contributors.add(source)
        self.received_bytes += p.length
        effects: list[FetchEffect] = [WriteChunk(p.index, p.offset, reply.data)]
        if wanted.received == self.manifest.artifacts[p.index].nbytes:
            self._verifying.add(p.index)
            effects.append(VerifyArtifact(p.index))
        return effects

    def on_verified(self, index: int, ok: bool) -> None:
        """The driver hashed artifact `index`: a mismatch fetches it again, from sources that
        did not supply these bytes (unless `retarget` no longer wants it: then it is dropped)."""
        self._verifying.discard(index)
        wanted = self._wanted.get(index)
        if wanted is None:
            return
        if index in self._leaving and not ok:  # no longer wanted: not fetched again
            self._leaving.discard(index)
            del self._wanted[index]
            self.total_bytes -= self.manifest.artifacts[index].nbytes
            return
        self._leaving.discard(index)
        if ok:
            self.verified.add(index)
            self.verified_bytes += self.manifest.artifacts[index].nbytes
            return
        wanted.missing = self._chunks(index)
        wanted.received = 0
        if len(wanted.contributors) == 1:
            wanted.excluded |= wanted.contributors
        else:
            wanted.single = True
            wanted.suspects = set(wanted.contributors)
        wanted.pinned = None
        wanted.contributors = set()
        self._check_failed()

    def retarget(self, wanted: Iterable[int]) -> None:
        """Fetch `wanted` from now on (the plan moved mid-fetch). Artifacts no longer wanted
        are dropped, with their outstanding requests (late replies are ignored), unless they
        arrived whole (verified, or being hashed: kept if they match); new ones are added.
        What arrived of artifacts still wanted is kept: nothing is asked twice."""
        target = set(wanted)
        self._leaving -= target
        for index in list(self._wanted):
            if index in target or index in self.verified:
                continue
            if index in self._verifying:  # it arrived whole: kept if its hash matches
                self._leaving.add(index)
                continue
            for request_id, p in list(self._pending.items()):
                if p.index == index:
                    self._drop(request_id, requeue=False)
            del self._wanted[index]
            self.failed.pop(index, None)
        self._empty = [i for i in self._empty if i in self._wanted]
        for index in sorted(target - self._wanted.keys()):
            self._wanted[index] = _Wanted(missing=self._chunks(index))
            if not self._wanted[index].missing:
                self._empty.append(index)
        self.total_bytes = sum(self.manifest.artifacts[i].nbytes for i in self._wanted)
        self._check_failed()

    def on_source_lost(self, source: bytes) -> None:
        """`source`'s lane died: its outstanding chunks go to whoever else holds them."""
        for request_id, p in list(self._pending.items()):
            if p.source == source:
                self._drop(request_id)
        self._sources = [s for s in self._sources if s != source]
        for wanted in self._wanted.values():
            if wanted.pinned == source:
                wanted.pinned = None

    # -- internals ------------------------------------------------------------------------
    def _drop(self, request_id: int, *, requeue: bool = True) -> None:
        p = self._pending.pop(request_id)
        self._in_flight[p.source] -= p.length
        if requeue and p.index in self._wanted:
            self._wanted[p.index].missing.append((p.offset, p.length))

    def _usable(self, source: bytes, wanted: _Wanted) -> bool:
        """Not excluded for this artifact, and not struck out, or struck out with nothing in
        flight: a source that keeps timing out is asked one chunk at a time until it answers
        (it may be busy, not gone; the view drops a dead one)."""
        if source in wanted.excluded:
            return False
        struck = self._strikes.get(source, 0) >= self.config.max_strikes
        return not struck or self._in_flight.get(source, 0) == 0

    def _pick(self, index: int, wanted: _Wanted) -> bytes | None:
        """The usable source with a chunk's room in its window: fewest recent timeouts first,
        then the most room (ties: the earlier listed)."""
        if wanted.pinned is not None:
            room = self.config.window_bytes - self._in_flight.get(wanted.pinned, 0)
            usable = self._usable(wanted.pinned, wanted) and wanted.pinned in self._sources
            return wanted.pinned if usable and room >= self.config.chunk_bytes else None
        best: bytes | None = None
        best_rank = (0, 0, 0)
        for source in self._sources:
            if not self._usable(source, wanted):
                continue
            room = self.config.window_bytes - self._in_flight.get(source, 0)
            rank = (source not in wanted.suspects, -self._strikes.get(source, 0), room)
            if room >= self.config.chunk_bytes and (best is None or rank > best_rank):
                best, best_rank = source, rank
        if best is not None and wanted.single:
            wanted.pinned = best
        return best

    def _check_failed(self) -> None:
        """Artifacts no listed source may supply any more, with nothing in flight, fail
        (with no source listed at all, the fetch waits for one instead)."""
        if not self._sources:
            return
        for index, wanted in self._wanted.items():
            if index in self.verified or index in self._verifying or not wanted.missing:
                continue
            if any(p.index == index for p in self._pending.values()):
                continue
            if any(s not in wanted.excluded for s in self._sources):
                continue
            name = self.manifest.artifacts[index].name
            self.failed[index] = (
                f"{name}: every peer that holds model {self.model_id[:16]} refused it or "
                f"sent bytes that do not match its manifest ({len(wanted.excluded)} tried)"
            )

    def failure(self) -> str | None:
        """Why the fetch cannot finish now (None: it can, or it did)."""
        if not self.failed:
            return None
        first = min(self.failed)
        more = len(self.failed) - 1
        return self.failed[first] + (f" (and {more} more)" if more else "")

    def forget_failures(self) -> None:
        """Try failed artifacts again (e.g. after new sources appeared)."""
        for index in list(self.failed):
            self._wanted[index].excluded.clear()
        self.failed.clear()
