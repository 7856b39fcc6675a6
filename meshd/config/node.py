"""`NodeConfig`: every key the daemon reads, typed, with its defaults and validation.

Each check raises `ConfigError` naming the key; `meshd.config.sources` adds where it was set.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
from pathlib import Path

import msgspec

from meshd.config.tables import ApiConfig, NatDialConfig, redacted_repr
from meshd.mesh.discovery import DiscoveryConfig
from meshd.mesh.jointoken import (
    MIN_SECRET_CHARS,
    Address,
    AddressError,
    JoinTokenError,
    decode_join_token,
    parse_peer_address,
)
from meshd.mesh.membership_config import MembershipConfig
from meshd.net.bulk import CadenceConfig
from meshd.net.emulator import LinkProfile
from meshd.plan.inputs import PlannerConfig
from meshd.speculative.config import SpecConfig
from meshd.stage.host_config import StageHostConfig
from meshd.stage.leases import SESSION_LEASE_S
from protocol import RemoteProtocolError
from protocol.artifacts import FetchConfig
from protocol.config import LaneConfig
from protocol.noise import x25519_public_from_ed25519_public
from protocol.punch import PunchConfig

DEFAULT_LANE_PORT = 7391
ENV_PREFIX = "MESHD_"
# Names the config file; it is not a key, so the unknown-variable check skips it.
CONFIG_FILE_ENV = "MESHD_CONFIG"
SECRET_KEYS: tuple[str, ...] = ("mesh_secret", "api.key", "join_token")
MAX_SECRET_FILE_BYTES = 4096
# sun_path holds 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH_BYTES = 107
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# "auto": the checkpoint's own (`Checkpoint.default_quantization`: "none" for safetensors,
# "gguf" for GGUF files: their tensors as stored, on CPU stages). q8_0 ... q6_k quantize a
# checkpoint at load into ggml's block formats (`meshd.model.quant.BLOCK_QUANTIZATIONS`);
# int8 and int4 are aliases of q8_0 and q4_k (`meshd.model.quant.ALIASES`).
QUANTIZATIONS: tuple[str, ...] = (
    "auto", "none", "int8", "int4", "gguf", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k",
)  # fmt: skip
LOG_FORMATS: tuple[str, ...] = ("text", "json")
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_HEX_KEY = re.compile(r"^[0-9a-fA-F]{64}$")


class ConfigError(ValueError):
    """A key is unknown, mistyped or invalid. `key` is dotted (`lane.dead_after_s`) or "";
    `source` says where it was set ("config file PATH", "env NAME", "flag --x") when known."""

    def __init__(self, message: str, *, key: str, source: str | None = None) -> None:
        super().__init__(message if source is None else f"{message} (set by {source})")
        self.key = key
        self.source = source


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything one meshd daemon is told (see docs/configuration.md for each key)."""

    state_dir: str
    mesh_secret: str = ""
    mesh_secret_file: str = ""
    join_token: str = ""
    listen_host: str = "0.0.0.0"
    listen_port: int = DEFAULT_LANE_PORT
    control_socket: str = ""
    # One model, or a list: the node holds every one (meshd/node/models.py).
    model: str | tuple[str, ...] = ""
    # Where fetched models (`mesh:ID`) and cached tensor hashes live ("" = the state dir).
    model_cache_dir: str = ""
    # A `mesh:ID` spare fetches ahead the layers it would take over (meshd/node/prefetch.py).
    prefetch: bool = True
    # At most this many bytes of take-over tensors (held or fetched) per spare; 0 = no limit.
    prefetch_max_bytes: int = 0
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    kv_dtype: str = "auto"
    threads: int = 0
    memory_budget_bytes: int = 0
    layers: tuple[int, int] | None = None
    join: tuple[str, ...] = ()
    admitted_keys: tuple[str, ...] = ()
    revoked_keys: tuple[str, ...] = ()
    log_format: str = "text"
    log_level: str = "info"
    # Failure handling and operator commands (seconds).
    recovery_timeout_s: float = 20.0
    suspect_hold_s: float = 10.0
    drain_timeout_s: float = 300.0
    # A stage frees a session after this long without a window or keep-alive from its
    # coordinator (coordinators renew their sessions every third of it).
    session_lease_s: float = SESSION_LEASE_S
    # SIGTERM: how long in-flight requests may run on before they are ended with an error.
    graceful_timeout_s: float = 30.0
    # Largest context (prompt + completion) the planner sizes KV for; 0 = the model's own.
    context_tokens: int = 0
    # The component tables (docs/configuration.md has a section for each).
    api: ApiConfig = ApiConfig()
    mdns: DiscoveryConfig = DiscoveryConfig()
    membership: MembershipConfig = MembershipConfig()
    lane: LaneConfig = LaneConfig()
    spec: SpecConfig = SpecConfig()
    planner: PlannerConfig = PlannerConfig()
    stage: StageHostConfig = StageHostConfig()
    fetch: FetchConfig = FetchConfig()
    bulk: CadenceConfig = CadenceConfig()
    nat: NatDialConfig = NatDialConfig()
    punch: PunchConfig = PunchConfig()
    emulate: LinkProfile | None = None

    def __post_init__(self) -> None:
        _check_network(self)
        _check_secrets(self)
        _check_compute(self)
        _check_timers(self)
        for key in ("admitted_keys", "revoked_keys"):
            for hex_key in getattr(self, key):
                _check_public_key(key, hex_key)
        _choice("log_format", self.log_format, LOG_FORMATS)
        _choice("log_level", self.log_level, LOG_LEVELS)

    def __repr__(self) -> str:
        return redacted_repr(self, SECRET_KEYS)

    @property
    def models(self) -> tuple[str, ...]:
        """The models this node holds, the first first ("" = the built-in model)."""
        return (self.model,) if isinstance(self.model, str) else self.model

    def model_cache_path(self) -> Path:
        """The root of fetched models and tensor-hash caches (`model_cache_dir` or `state_dir`)."""
        return Path(self.model_cache_dir or self.state_dir)

    def control_socket_path(self) -> Path:
        """The control socket for meshctl (`<state_dir>/control.sock` unless set)."""
        return Path(self.control_socket or os.path.join(self.state_dir, "control.sock"))

    def read_mesh_secret(self) -> str:
        """The mesh secret from `mesh_secret`, `mesh_secret_file` or `join_token`."""
        if self.mesh_secret:
            return self.mesh_secret
        if self.mesh_secret_file:
            return _read_secret_file(self.mesh_secret_file, "mesh_secret_file")
        if self.join_token:
            return decode_join_token(self.join_token).secret
        raise ConfigError(
            "no mesh secret: set mesh_secret_file (or mesh_secret, or join_token)",
            key="mesh_secret",
        )

    def read_api_key(self) -> str | None:
        """The API key from `api.key` or `api.key_file`, or None when the API is open."""
        if self.api.key:
            return self.api.key
        if self.api.key_file:
            return _read_secret_file(self.api.key_file, "api.key_file")
        return None

    def bootstrap_peers(self) -> list[Address]:
        """Peers to contact first: `join`, then the join token's addresses (no duplicates)."""
        peers = [parse_peer_address(a, DEFAULT_LANE_PORT) for a in self.join]
        if self.join_token:
            peers += decode_join_token(self.join_token).addresses
        return list(dict.fromkeys(peers))

    def admitted_public_keys(self) -> tuple[bytes, ...]:
        """`admitted_keys` as raw Ed25519 keys (empty = every holder of the mesh secret)."""
        return tuple(bytes.fromhex(k) for k in self.admitted_keys)

    def revoked_public_keys(self) -> tuple[bytes, ...]:
        """`revoked_keys` as raw Ed25519 keys (never admitted)."""
        return tuple(bytes.fromhex(k) for k in self.revoked_keys)


def _check_network(c: NodeConfig) -> None:
    if not c.state_dir:
        raise ConfigError("state_dir must not be empty", key="state_dir")
    try:
        ipaddress.ip_address(c.listen_host)
    except ValueError:
        raise ConfigError(
            f"listen_host {c.listen_host!r} is not an IP address", key="listen_host"
        ) from None
    if not 0 <= c.listen_port <= 65535:
        raise ConfigError("listen_port must be in 0..65535 (0 = any free port)", key="listen_port")
    socket_bytes = len(os.fsencode(c.control_socket_path()))
    if socket_bytes > MAX_UNIX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"control_socket path is {socket_bytes} bytes; a Unix socket path may have at most "
            f"{MAX_UNIX_SOCKET_PATH_BYTES}: set a shorter control_socket or state_dir",
            key="control_socket",
        )
    for peer in c.join:
        try:
            parse_peer_address(peer, DEFAULT_LANE_PORT)
        except AddressError as exc:
            raise ConfigError(f"join: {exc}", key="join") from None


def _check_secrets(c: NodeConfig) -> None:
    _one_of(c, "mesh_secret", "mesh_secret_file")
    if c.mesh_secret and len(c.mesh_secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"mesh_secret is too short: use at least {MIN_SECRET_CHARS} characters "
            f"(e.g. the output of `openssl rand -base64 32`)",
            key="mesh_secret",
        )
    if c.join_token:
        try:
            token = decode_join_token(c.join_token)
        except JoinTokenError as exc:
            raise ConfigError(f"join_token: {exc}", key="join_token") from None
        if len(token.secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"join_token: its mesh secret is shorter than {MIN_SECRET_CHARS} characters",
                key="join_token",
            )
        if c.mesh_secret_file or (c.mesh_secret and c.mesh_secret != token.secret):
            raise ConfigError(
                "join_token carries the mesh secret: set either join_token or "
                "mesh_secret/mesh_secret_file, not both",
                key="join_token",
            )


def _check_compute(c: NodeConfig) -> None:
    if not _DEVICE.match(c.device):
        raise ConfigError(
            f"device {c.device!r} is unknown: use auto, cpu, cuda, cuda:N or mps", key="device"
        )
    _choice("dtype", c.dtype, DTYPES)
    _choice("quantization", c.quantization, QUANTIZATIONS)
    _choice("kv_dtype", c.kv_dtype, DTYPES)
    if not c.models:
        raise ConfigError('model: give at least one model ("" = the built-in one)', key="model")
    if len(set(c.models)) != len(c.models):
        raise ConfigError(f"model: a model is listed twice in {list(c.models)}", key="model")
    if c.threads < 0:
        raise ConfigError(
            "threads must be >= 0 (0 = every core this process may use)", key="threads"
        )
    if c.context_tokens < 0:
        raise ConfigError(
            "context_tokens must be >= 0 (0 = the model's own context)", key="context_tokens"
        )
    if c.prefetch_max_bytes < 0:
        raise ConfigError(
            "prefetch_max_bytes must be >= 0 (0 = no limit)", key="prefetch_max_bytes"
        )
    if c.memory_budget_bytes < 0:
        raise ConfigError(
            "memory_budget_bytes must be >= 0 (0 = what the device offers)",
            key="memory_budget_bytes",
        )
    if c.layers is not None and not 0 <= c.layers[0] < c.layers[1]:
        raise ConfigError(
            f"layers {list(c.layers)} must be [start, stop) with 0 <= start < stop", key="layers"
        )


def _check_timers(c: NodeConfig) -> None:
    for key in (
        "recovery_timeout_s",
        "suspect_hold_s",
        "drain_timeout_s",
        "session_lease_s",
        "graceful_timeout_s",
    ):
        value = getattr(c, key)
        if not 0 < value < math.inf:
            raise ConfigError(f"{key} must be a positive number of seconds, got {value}", key=key)


def _one_of(c: NodeConfig, a: str, b: str) -> None:
    if getattr(c, a) and getattr(c, b):
        raise ConfigError(f"set {a} or {b}, not both", key=b)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} {value!r} is unknown: use {', '.join(choices)}", key=key)


def _check_public_key(key: str, hex_key: str) -> None:
    try:
        if not _HEX_KEY.match(hex_key):
            raise ValueError
        x25519_public_from_ed25519_public(bytes.fromhex(hex_key))
    except (ValueError, RemoteProtocolError):
        raise ConfigError(
            f"{key}: {hex_key!r} is not an Ed25519 public key (64 hex digits)", key=key
        ) from None


def _read_secret_file(path: str, key: str) -> str:
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            raw = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}", key=key) from None
    if mode & 0o007:
        raise ConfigError(
            f"{key}: {path} has mode {mode:04o} and is readable by anyone on this machine. "
            f"Fix: chmod 600 '{path}'",
            key=key,
        )
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{key}: {path} is larger than {MAX_SECRET_FILE_BYTES} bytes", key=key)
    secret = raw.decode("utf-8", errors="replace").strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{key}: the secret in {path} is shorter than {MIN_SECRET_CHARS} characters", key=key
        )
    return secret
