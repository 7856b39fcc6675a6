"""Application messages carried on lanes: the stage pipeline's verify windows and replies.

Messages are `msgspec.Struct`s in one tagged union, encoded with msgpack. Decoding enforces a
hard size limit and turns every malformed input into `RemoteProtocolError`. Tensors travel as
raw little-endian bytes with a dtype tag and shape (`TensorBlob`); converting them to torch is
the stage host's job, so this module stays sans-IO and torch-free.

The path of a window (DESIGN.md): coordinator → stage 0 (`VerifyWindow`), stage i → stage i+1
(`StageHidden`, carrying the window's metadata and the hidden states), last stage →
coordinator (`VerifyReply`). Logits never cross the network.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.errors import LocalProtocolError, RemoteProtocolError

# Hard ceiling for one encoded message (the lane negotiates its own limit, at most this).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_WINDOW_TOKENS = 8192
MAX_SESSION_ID_CHARS = 64
# Sessions one keep-alive may renew (a coordinator with more sends several).
MAX_KEEPALIVE_SESSIONS = 1024
# Prefix-cache entry ids are chosen by coordinators at random in 1..MAX_ENTRY_ID (0: none).
MAX_ENTRY_ID = 2**63 - 1
# Entries one `DropEntries` may name (a coordinator with more sends several).
MAX_DROP_ENTRIES = 1024
# A stage's answer to an open whose prefix entry it lacks (`StageError.code`), and the epoch it
# opens that session at, so the windows sent for the hit (epoch 0) are dropped as stale.
PREFIX_MISS = "prefix_miss"
PREFIX_MISS_EPOCH = 1
# Most alternatives a window may ask the last stage to report per token (OpenAI allows 20).
MAX_TOP_LOGPROBS = 20

DType = Literal["f32", "f16", "bf16"]
DTYPE_BYTES: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2}


class TensorBlob(msgspec.Struct, frozen=True, array_like=True):
    """A dense tensor as raw bytes: row-major, little-endian."""

    dtype: DType
    shape: tuple[int, ...]
    data: bytes

    def validate(self) -> None:
        """Raise RemoteProtocolError unless the byte count matches dtype and shape."""
        count = 1
        for dim in self.shape:
            if dim < 0:
                raise RemoteProtocolError("negative tensor dimension")
            count *= dim
        if count * DTYPE_BYTES[self.dtype] != len(self.data):
            raise RemoteProtocolError(
                f"tensor of shape {self.shape} {self.dtype} needs "
                f"{count * DTYPE_BYTES[self.dtype]} bytes, got {len(self.data)}"
            )


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """The request's sampling configuration, as the last stage needs it to verify."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


class StageTiming(msgspec.Struct, frozen=True, array_like=True):
    """How long one stage spent on one window (seconds), and the load it saw.

    `compute_s` is the wall time of the pass that computed the window; `batch_sessions` sessions
    shared that pass (their windows ran as one batch) and `queued_sessions` other sessions had
    windows waiting behind it. The coordinator's window policy reads these as stage load.
    `mtp_s` is the part of `compute_s` this window spent in the MTP draft heads (last stage).
    """

    stage: int
    queue_s: float
    compute_s: float
    batch_sessions: int = 1
    queued_sessions: int = 0
    mtp_s: float = 0.0


class OpenSession(msgspec.Struct, frozen=True, tag="open"):
    """Coordinator → every stage: allocate KV for a session and learn its route.

    `next_hop` is the static key of the next stage (None on the last stage); `coordinator` is
    the key the last stage replies to. `stage_index` orders timings.
    """

    session: str
    model_id: str
    max_positions: int
    stage_index: int
    coordinator: bytes
    next_hop: bytes | None = None
    wire_dtype: DType = "f32"
    mtp_depth: int = 0
    # The layers the coordinator expects this stage to hold ([-1, -1): not checked). A node
    # that holds other layers (or none yet) answers StageError(code="wrong_layers").
    layer_start: int = -1
    layer_end: int = -1
    # The quantization the route's stages hold the model at ("": not checked). A node holding
    # another answers StageError(code="wrong_quantization"): its tokens would differ.
    quantization: str = ""
    # Prefix cache: start the session with the KV of positions [0, prefix_positions) copied
    # from the stage's cache entry `prefix_entry` (0: start empty). The prefill then begins at
    # prefix_positions. A stage that no longer holds the entry (or not that many positions)
    # opens the session empty at epoch 1, so it drops the epoch-0 windows sent for the hit,
    # and answers StageError(code="prefix_miss"); the coordinator then rolls every stage to
    # epoch 1 and prefills from position 0.
    prefix_entry: int = 0
    prefix_positions: int = 0


class CloseSession(msgspec.Struct, frozen=True, tag="close"):
    """Coordinator → every stage: free the session's KV.

    With `keep_entry` (non-zero), the stage first keeps the KV of positions [0, keep_positions)
    as prefix-cache entry `keep_entry`, if it holds that many positions and its memory budget
    has room (live sessions always come first; older entries are evicted least recently used
    first). `replaces` names an entry the new one covers (the same tokens and more): the stage
    drops it, kept or not (the coordinator's index no longer names it). Keeping is best effort
    and never answered: a later open that finds no entry answers `prefix_miss`.
    """

    session: str
    keep_entry: int = 0
    keep_positions: int = 0
    replaces: int = 0


class DropEntries(msgspec.Struct, frozen=True, tag="drop_entries"):
    """Coordinator → a stage node: free these prefix-cache entries; its index no longer names
    them (evicted least recently used, replaced by a longer prefix, missed on another stage, or
    its route forgotten), so no open will ever ask for them again.

    Fire-and-forget and idempotent: never answered, an id the stage does not hold is skipped,
    and so is an entry kept for another coordinator (only the node that asked a stage to keep
    an entry may drop it: the stage compares the sender's lane key with the entry's
    coordinator).
    """

    entries: list[int]


class SessionKeepAlive(msgspec.Struct, frozen=True, tag="keepalive"):
    """Coordinator → a stage node: renew the leases of these open sessions.

    A stage frees a session whose lease lapses (`session_lease_s` without a window or a
    keep-alive), so a coordinator that crashed never leaves KV behind; a live coordinator sends
    this every third of the lease for the sessions it has open there. A stage answers a session
    it does not hold with `StageError(code="session_expired")`, so the coordinator re-plans.
    """

    sessions: list[str]


class Rollback(msgspec.Struct, frozen=True, tag="rollback"):
    """Coordinator → every stage: windows of an epoch below `epoch` are stale; drop them."""

    session: str
    epoch: int


class VerifyWindow(msgspec.Struct, frozen=True, tag="window"):
    """Coordinator → stage 0: run `tokens` at positions base_pos.. and verify the drafts.

    The last `n_draft` tokens are drafts; the ones before are committed context (a prefill
    chunk has n_draft = 0). With `sample` false (a prefill chunk that is not the last) the last
    stage computes no logits and sends no reply.
    """

    session: str
    epoch: int
    window_id: int
    base_pos: int
    tokens: list[int]
    sampling: Sampling
    n_draft: int = 0
    sample: bool = True
    mtp_tokens: int = 0
    # -1: no log-probs (the last stage computes none). n >= 0: the reply carries, for each
    # token it commits, that token's log-prob and the n most likely ids with theirs.
    logprobs: int = -1
    # A grammar's allowed tokens for each row that chooses a token (n_draft + 1 rows): rows of
    # little-endian 32-bit words, bit i of word j allowing token 32·j + i, zlib-compressed.
    # Empty: no grammar (the last stage masks nothing).
    mask: bytes = b""


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One committed token's log-prob under the model's own distribution (log-softmax of the
    logits row that chose it, before temperature and filters), and the most likely ids."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class StageHidden(msgspec.Struct, frozen=True, tag="hidden"):
    """Stage i → stage i+1: the window's metadata and this stage's output hidden states."""

    window: VerifyWindow
    hidden: TensorBlob
    timings: list[StageTiming]


class VerifyReply(msgspec.Struct, frozen=True, tag="reply"):
    """Last stage → coordinator: how much of the window's draft the model accepted.

    `next_token` is the model's own token after the accepted drafts (a correction, or the bonus
    token when every draft was accepted); `mtp_draft` holds MTP proposals for the tokens after
    it — a separate field, so target tokens and drafts can never be confused.
    """

    session: str
    window_id: int
    epoch: int
    accepted_len: int
    next_token: int
    mtp_draft: list[int]
    stage_timings: list[StageTiming]
    # One entry per committed token (accepted drafts, then next_token) when the window asked
    # for log-probs; empty otherwise.
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)


class StageError(msgspec.Struct, frozen=True, tag="error"):
    """Any stage → coordinator: the window or session failed there (typed code + message).

    `code="overloaded"` refuses a new session (the stage's KV memory or queue is full); it may
    succeed after `retry_after_s`.
    """

    session: str
    code: str
    message: str
    window_id: int = -1
    retry_after_s: float = 0.0


class NodeHello(msgspec.Struct, frozen=True, tag="hello"):
    """First message on every new lane, both ways: the sender's Ed25519 node key.

    The receiver accepts it only if the key maps to the lane's authenticated X25519 static key,
    so a node cannot claim another's identity.
    """

    node_key: bytes


class StageCommand(msgspec.Struct, frozen=True, tag="command"):
    """Operator → one node (forwarded by meshctl's daemon): stop or resume hosting a stage.

    `action` is "kill" (stop at once, as a crash would; with `drain`, after its sessions end)
    or "recover" (host again, and re-plan).
    """

    action: Literal["kill", "recover"]
    drain: bool = False


Message = (
    OpenSession
    | CloseSession
    | DropEntries
    | SessionKeepAlive
    | Rollback
    | VerifyWindow
    | StageHidden
    | VerifyReply
    | StageError
    | NodeHello
    | StageCommand
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Encode a message; LocalProtocolError if it breaks a limit (our bug, not the peer's)."""
    try:
        _check(message)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from None
    data = _encoder.encode(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return data


def decode(data: bytes) -> Message:
    """Decode and validate one message; anything malformed raises RemoteProtocolError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed message: {exc}") from None
    _check(message)
    return message


def _check_session(session: str) -> None:
    if not 0 < len(session) <= MAX_SESSION_ID_CHARS:
        raise RemoteProtocolError("session id must be 1..64 characters")


def _check_entry(entry: int, positions: int, what: str) -> None:
    """An entry id and its positions: both zero, or an id in range with positions >= 1."""
    if not 0 <= entry <= MAX_ENTRY_ID or not 0 <= positions <= 2**31:
        raise RemoteProtocolError(f"{what}: prefix entry or positions out of range")
    if (entry == 0) != (positions == 0):
        raise RemoteProtocolError(f"{what}: a prefix entry needs positions, and positions one")


def _check_window(w: VerifyWindow) -> None:
    _check_session(w.session)
    if not 0 < len(w.tokens) <= MAX_WINDOW_TOKENS:
        raise RemoteProtocolError(f"a window holds 1..{MAX_WINDOW_TOKENS} tokens")
    if not 0 <= w.n_draft < len(w.tokens):
        raise RemoteProtocolError("n_draft must leave at least one context token")
    if w.base_pos < 0 or w.epoch < 0 or w.window_id < 0 or w.mtp_tokens < 0:
        raise RemoteProtocolError("negative position, epoch, window id or mtp count")
    if any(t < 0 for t in w.tokens):
        raise RemoteProtocolError("negative token id")
    if not -1 <= w.logprobs <= MAX_TOP_LOGPROBS:
        raise RemoteProtocolError(f"logprobs must be -1..{MAX_TOP_LOGPROBS}")
    s = w.sampling
    if not (s.temperature >= 0 and 0 < s.top_p <= 1 and s.top_k >= 0):
        raise RemoteProtocolError("sampling parameters out of range")


def _check(message: Message) -> None:
    if isinstance(message, VerifyWindow):
        _check_window(message)
    elif isinstance(message, StageHidden):
        _check_window(message.window)
        message.hidden.validate()
        if not message.hidden.shape or message.hidden.shape[0] != len(message.window.tokens):
            raise RemoteProtocolError("hidden states must have one row per window token")
    elif isinstance(message, OpenSession):
        _check_session(message.session)
        if message.max_positions <= 0 or message.stage_index < 0 or message.mtp_depth < 0:
            raise RemoteProtocolError("open: max_positions, stage_index, mtp_depth out of range")
        if message.layer_start < -1 or message.layer_end < message.layer_start:
            raise RemoteProtocolError("open: bad expected layer range")
        _check_entry(message.prefix_entry, message.prefix_positions, "open")
        if message.prefix_positions >= message.max_positions:
            raise RemoteProtocolError("open: a prefix must leave room for the prompt's rest")
    elif isinstance(message, CloseSession):
        _check_session(message.session)
        _check_entry(message.keep_entry, message.keep_positions, "close")
        if not 0 <= message.replaces <= MAX_ENTRY_ID:
            raise RemoteProtocolError("close: replaced entry id out of range")
    elif isinstance(message, NodeHello):
        if len(message.node_key) != 32:
            raise RemoteProtocolError("hello: a node key is 32 bytes")
    elif isinstance(message, StageCommand):
        pass
    elif isinstance(message, DropEntries):
        if not 0 < len(message.entries) <= MAX_DROP_ENTRIES:
            raise RemoteProtocolError(f"drop: 1..{MAX_DROP_ENTRIES} entries")
        if not all(0 < entry <= MAX_ENTRY_ID for entry in message.entries):
            raise RemoteProtocolError("drop: prefix entry id out of range")
    elif isinstance(message, SessionKeepAlive):
        if len(message.sessions) > MAX_KEEPALIVE_SESSIONS:
            raise RemoteProtocolError(f"keep-alive: at most {MAX_KEEPALIVE_SESSIONS} sessions")
        for session in message.sessions:
            _check_session(session)
    elif isinstance(message, VerifyReply):
        _check_session(message.session)
        if message.accepted_len < 0 or message.next_token < 0:
            raise RemoteProtocolError("reply: negative accepted_len or token")
    else:
        _check_session(message.session)
