"""The tables of `NodeConfig` that have no home in a component: the HTTP API and NAT dialing.

Every table of the tree is a msgspec Struct validated one way: `__post_init__` raises a
ValueError whose message starts with the field's name, and the loader
(`meshd.config.sources`) adds the table and where the value was set.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Collection

import msgspec

from meshd.mesh.jointoken import MIN_SECRET_CHARS
from meshd.net.web_origin import parse_host, parse_origin

DEFAULT_API_PORT = 7392


def redacted_repr(config: msgspec.Struct, secrets: Collection[str]) -> str:
    """`Name(field=value, ...)` with each set secret shown as <redacted>: configs end up in
    logs and tracebacks, secrets never may."""
    fields = ", ".join(
        f"{f}={'<redacted>' if f in secrets and getattr(config, f) else repr(getattr(config, f))}"
        for f in config.__struct_fields__
    )
    return f"{type(config).__name__}({fields})"


class NatDialConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the daemon falls back to NAT traversal when a direct dial fails (the `[nat]`
    table; the punch and relay limits are `[punch]`)."""

    # After a peer needed an introduction, skip dialing its advertised address this long.
    direct_retry_s: float = 60.0
    # The larger-keyed side of a pair waits this long for the other's lane before punching.
    yield_s: float = 2.0
    # Introducers tried per dial (each costs up to a punch plus a handshake when it fails).
    max_introducers: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.direct_retry_s < math.inf:
            raise ValueError("direct_retry_s must be a positive number of seconds")
        if not 0 <= self.yield_s < math.inf:
            raise ValueError("yield_s must be >= 0 seconds")
        if self.max_introducers < 1:
            raise ValueError("max_introducers must be >= 1")


class ApiConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The OpenAI-compatible HTTP API: where it listens, its key, and the limits of its HTTP
    edge (the `[api]` table; each key is also accepted flat at the top level, `api_port`)."""

    # Loopback by default: beyond it the API needs a key.
    host: str = "127.0.0.1"
    port: int = DEFAULT_API_PORT
    # The key clients send as `Authorization: Bearer KEY` ("" with no key_file = no key).
    key: str = ""
    key_file: str = ""
    # Complete request headers, and a whole request body, must arrive within these (seconds),
    # or the connection is closed (a body too slow gets 408 first).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Largest request body accepted (413 beyond).
    max_body_bytes: int = 4 * 1024 * 1024
    # A refused oversized body is still read (and dropped) up to this much, so that the client
    # finishes sending and can read the 413 instead of a reset connection.
    max_drain_bytes: int = 64 * 1024 * 1024
    # Names the API also answers to besides its own address and localhost (`name` for any
    # port, or `name:port`), and the web origins that may call it from their pages (CORS);
    # others are refused so that no web page can drive the API (docs/api.md).
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.host != "localhost":
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(f"host {self.host!r} is not an IP address or localhost") from None
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535 (0 = any free port)")
        if self.key and self.key_file:
            raise ValueError("key_file and key are both set: set one")
        if self.key and len(self.key) < MIN_SECRET_CHARS:
            raise ValueError(
                f"key is too short: use at least {MIN_SECRET_CHARS} characters "
                f"(e.g. the output of `openssl rand -base64 32`)"
            )
        if not self.is_loopback and not (self.key or self.key_file):
            raise ValueError(
                f"key (or key_file) must be set: host {self.host} is not a loopback address, "
                f"so the API would be open to the network; or bind host to 127.0.0.1"
            )
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.max_drain_bytes < 0:
            raise ValueError("max_drain_bytes must be >= 0")
        for host in self.allowed_hosts:
            try:
                parse_host(host)
            except ValueError as exc:
                raise ValueError(
                    f"allowed_hosts: {exc}; give a host name or address, or host:port"
                ) from None
        for origin in self.cors_origins:
            try:
                parse_origin(origin)
            except ValueError as exc:
                raise ValueError(
                    f"cors_origins: {exc}; give origins such as https://app.example.com"
                ) from None

    def __repr__(self) -> str:
        return redacted_repr(self, ("key",))

    @property
    def is_loopback(self) -> bool:
        """True when the API listens on loopback only (then no key is required)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
