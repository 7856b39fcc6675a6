"""Web origins and HTTP `Host` values: parsed and normalised, so that two spellings of one
address compare equal (`LOCALHOST:80` and `localhost`, `[0:0::1]` and `[::1]`).

Pure functions, shared by the config's checks (`api_allowed_hosts`, `api_cors_origins`) and
the API's Host and Origin policy (`meshd/api/origin_policy.py`). Every parser raises
ValueError saying what is wrong with the text.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# The port a scheme implies when a URL or Host names none (RFC 6454 drops it from origins).
DEFAULT_PORTS = {"http": 80, "https": 443}
# A DNS label; `_` appears in real local names (and in Docker's), so it is accepted.
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True)
class HostPort:
    """A host (lower case; an IP address in its canonical form, IPv6 without brackets) and
    the port named with it, or None where none was."""

    host: str
    port: int | None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


@dataclass(frozen=True)
class Origin:
    """`scheme://host[:port]`; `port` is the one the scheme implies when the text had none."""

    scheme: str
    host: str
    port: int | None

    def __str__(self) -> str:
        """The origin as browsers serialise it (the default port left out)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port is None or DEFAULT_PORTS.get(self.scheme) == self.port:
            return f"{self.scheme}://{host}"
        return f"{self.scheme}://{host}:{self.port}"


def normalize_host(host: str) -> str:
    """A host name in lower case, or an IP address in canonical form (an IPv4-mapped IPv6
    address as its IPv4 address). ValueError when it is neither."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower()
        labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
        if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
            raise ValueError(f"{host!r} is not a host name or IP address") from None
        return name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def parse_host(text: str) -> HostPort:
    """`name`, `name:port`, `1.2.3.4:port`, `[ipv6]` or `[ipv6]:port` (a `Host` header's
    forms); a bare IPv6 address without brackets is accepted too (config files)."""
    port_text: str | None = None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: expected [ipv6] or [ipv6]:port")
        if ":" not in host:
            raise ValueError(f"{text!r}: only an IPv6 address goes in brackets")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text
    if port_text is not None and not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(f"{text!r}: the port must be a number in 1..65535")
    if ":" in host and not text.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r} is not a host name or IP address") from None
    return HostPort(normalize_host(host), int(port_text) if port_text is not None else None)


def parse_origin(text: str) -> Origin:
    """`scheme://host[:port]`, as a browser's `Origin` header carries it. `null` (what a
    sandboxed frame or a file sends) is no origin: ValueError."""
    scheme, sep, rest = text.partition("://")
    scheme = scheme.lower()
    if not sep or not _SCHEME.match(scheme):
        raise ValueError(f"{text!r} is not an origin: expected scheme://host[:port]")
    if not rest or any(c in rest for c in "/?#@"):
        raise ValueError(f"{text!r} is not an origin: expected scheme://host[:port], no path")
    host = parse_host(rest)
    return Origin(scheme, host.host, host.port or DEFAULT_PORTS.get(scheme))
