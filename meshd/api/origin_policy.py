"""Which requests a web page may make of the API: the Host, Origin and Content-Type rules.

A page the user visits can make the browser send requests to the loopback API: a "simple"
cross-origin POST (`text/plain`, form-encoded, multipart) goes without a CORS preflight, and
through DNS rebinding a page on the attacker's own name reaches the API as same-origin and
reads the answers (the class of Ollama's CVE-2024-28224). So:

- Host: without an API key, a request must name the API by the address it listens on, by
  `localhost`, `127.0.0.1` or `[::1]` with its port, or by a name in `api_allowed_hosts`; a
  rebound name is refused. With a key, the key protects the routes with data, and the Host
  rule guards the public routes (the console's static files).
- Origin: a request that carries one must come from the API's own origin (an allowed host)
  or from an origin in `api_cors_origins`; `null` is foreign.
- Content-Type: a body must be `application/json`, which a browser sends cross-origin only
  after a preflight, and preflights are answered only for `api_cors_origins`.

`decide` is the pure rule; `OriginMiddleware` (`auth.py`) applies it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.api.errors import ApiError
from meshd.net.web_origin import DEFAULT_PORTS, HostPort, Origin, parse_host, parse_origin

# Names that always mean this machine (a browser never resolves them elsewhere).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PREFLIGHT_MAX_AGE_S = 600
# What a cross-origin caller may send and read besides the CORS-safelisted headers.
ALLOWED_METHODS = "GET, POST"
ALLOWED_HEADERS = ("Authorization", "Content-Type")
EXPOSED_HEADERS = "Retry-After, retry-after-ms"
JSON_MEDIA_TYPE = "application/json"
# An HTTP header name (RFC 9110 token).
_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
# Methods whose body the API never reads.
_BODILESS = ("GET", "HEAD", "OPTIONS")


@dataclass(frozen=True)
class Seen:
    """What the rule looks at in a request (header values as sent, None when absent)."""

    method: str
    path: str
    scheme: str
    # The local address the connection arrived at; None when not a TCP socket.
    server: tuple[str, int] | None
    host: str | None
    origin: str | None
    content_type: str | None
    has_body: bool
    # An OPTIONS request with Origin and Access-Control-Request-Method.
    preflight: bool
    request_headers: str | None = None  # Access-Control-Request-Headers


@dataclass(frozen=True)
class Refuse:
    """Answer with `error`; `cors_origin` when the caller may read it (an allowed origin)."""

    error: ApiError
    cors_origin: str | None = None


@dataclass(frozen=True)
class AnswerPreflight:
    """A preflight from an allowed origin: 204 with these headers."""

    headers: dict[str, str]


@dataclass(frozen=True)
class Pass:
    """Serve the request; add CORS headers to its response when `cors_origin` is set."""

    cors_origin: str | None = None


Verdict = Refuse | AnswerPreflight | Pass


@dataclass(frozen=True)
class OriginPolicy:
    """The operator's settings: `allowed_hosts` (`api_allowed_hosts`: `name` for any port, or
    `name:port`), `cors_origins` (`api_cors_origins`), whether an API key protects the
    routes, and which GET paths are public (served without the key)."""

    allowed_hosts: tuple[HostPort, ...] = ()
    cors_origins: frozenset[str] = frozenset()
    key_required: bool = False
    public: frozenset[str] = frozenset()

    @classmethod
    def from_config(
        cls,
        allowed_hosts: Sequence[str],
        cors_origins: Sequence[str],
        *,
        key_required: bool,
        public: frozenset[str] = frozenset(),
    ) -> OriginPolicy:
        """From the config's texts (ValueError for one that does not parse)."""
        return cls(
            tuple(parse_host(h) for h in allowed_hosts),
            frozenset(str(parse_origin(o)) for o in cors_origins),
            key_required,
            public,
        )

    def decide(self, seen: Seen) -> Verdict:
        """What to do with a request."""
        public = seen.method in ("GET", "HEAD") and seen.path in self.public
        host_checked = not self.key_required or public
        if host_checked and (refused := self._check_host(seen)) is not None:
            return refused
        cors = None
        if seen.origin is not None:
            origin = _origin(seen.origin)
            if origin is not None and str(origin) in self.cors_origins:
                cors = str(origin)
            elif seen.preflight or not self._own(origin, seen):
                return Refuse(_foreign_origin(seen.origin))
        if seen.preflight and cors is not None:
            return AnswerPreflight(self._preflight_headers(cors, seen.request_headers))
        if seen.method not in _BODILESS and (seen.content_type is not None or seen.has_body):
            media_type = (seen.content_type or "").split(";", 1)[0].strip().lower()
            if media_type != JSON_MEDIA_TYPE:
                return Refuse(_unsupported_media_type(seen.content_type), cors)
        return Pass(cors)

    def allows_host(self, host: HostPort, scheme: str, server: tuple[str, int] | None) -> bool:
        """True when `host` names this API: its listening address or a loopback name, with
        its port or none (a browser always names a port other than the scheme's default, so
        no page elsewhere can send that), or an `allowed_hosts` entry."""
        port = host.port if host.port is not None else DEFAULT_PORTS.get(scheme)
        for allowed in self.allowed_hosts:
            if allowed.host == host.host and allowed.port in (None, port):
                return True
        if server is None:
            return False
        listen_host, listen_port = server
        own = (*LOOPBACK_NAMES, _canonical(listen_host))
        return host.port in (None, listen_port) and host.host in own

    def _check_host(self, seen: Seen) -> Refuse | None:
        host = _host(seen.host)
        if host is not None and self.allows_host(host, seen.scheme, seen.server):
            return None
        named = "no Host header" if seen.host is None else f"Host {seen.host!r}"
        expected = ""
        if seen.server is not None:
            port = seen.server[1]
            names = dict.fromkeys([str(HostPort(_canonical(seen.server[0]), port)),
                                   f"localhost:{port}", f"127.0.0.1:{port}"])  # fmt: skip
            expected = f" (this API answers to {', '.join(names)})"
        return Refuse(
            ApiError(
                403,
                f"{named} does not name this API{expected}; requests under other names are "
                f"refused so that a web page cannot reach the API through DNS rebinding. "
                f"To serve it under another name, add that name to api_allowed_hosts",
                code="host_not_allowed",
            )
        )

    def _own(self, origin: Origin | None, seen: Seen) -> bool:
        """The API's own origin: http(s) on a host this API answers to."""
        if origin is None or origin.scheme not in DEFAULT_PORTS:
            return False
        return self.allows_host(HostPort(origin.host, origin.port), origin.scheme, seen.server)

    def _preflight_headers(self, origin: str, requested: str | None) -> dict[str, str]:
        # The allowed origin's client may send the headers it asks for (the openai JS client
        # sends its own); only header names are echoed.
        names = list(ALLOWED_HEADERS)
        for name in (n.strip() for n in (requested or "").split(",")):
            if _TOKEN.match(name) and name.lower() not in (n.lower() for n in names):
                names.append(name)
        return {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ", ".join(names),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin",
        }


def cors_headers(origin: str) -> dict[str, str]:
    """What an actual response to an allowed cross-origin caller carries."""
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Expose-Headers": EXPOSED_HEADERS,
        "Vary": "Origin",
    }


def _host(text: str | None) -> HostPort | None:
    if text is None:
        return None
    try:
        return parse_host(text)
    except ValueError:
        return None


def _origin(text: str) -> Origin | None:
    try:
        return parse_origin(text)
    except ValueError:
        return None  # `null`, or garbage: foreign either way


def _canonical(host: str) -> str:
    try:
        return parse_host(host).host
    except ValueError:
        return host


def _foreign_origin(origin: str) -> ApiError:
    return ApiError(
        403,
        f"Origin {origin!r} may not use this API: a web page from another origin could "
        f"otherwise spend the mesh's compute or read its answers. To allow it, add it to "
        f"api_cors_origins",
        code="origin_not_allowed",
    )


def _unsupported_media_type(content_type: str | None) -> ApiError:
    got = f"got {content_type!r}" if content_type is not None else "none was sent"
    return ApiError(
        415,
        f"Content-Type must be {JSON_MEDIA_TYPE} ({got}): send the body as JSON with "
        f"Content-Type: {JSON_MEDIA_TYPE}",
        code="unsupported_media_type",
    )
