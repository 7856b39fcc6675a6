"""Serve the API app with hypercorn's trio worker inside the caller's nursery.

`serve_api` refuses to bind beyond loopback unless the app requires an API key. Cancelling the
caller's scope shuts the server down gracefully: it stops accepting, lets requests in flight
finish for up to `graceful_timeout_s`, then cancels them (a cancelled generation closes its
session on every stage), and returns.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette

from meshd.config.tables import ApiConfig

# The defaults of `[api]` (serve_api's own default timeout is the table's).
_API = ApiConfig()

log = logging.getLogger(__name__)


class ApiBindError(ValueError):
    """The API would listen beyond loopback without an API key."""


@dataclass(frozen=True)
class BoundAddress:
    """Where the API listens (the real port when 0 was asked for)."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        """`http://host:port/v1`, what OpenAI clients take as `base_url`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to anything


def check_bind(host: str, *, requires_api_key: bool) -> None:
    """Raise `ApiBindError` when `host` is not loopback and no API key protects the app."""
    if not requires_api_key and not is_loopback(host):
        raise ApiBindError(
            f"refusing to serve the API on {host}: it is not a loopback address, so the API "
            f"would be open to the network; set an API key or bind 127.0.0.1"
        )


async def serve_api(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    graceful_timeout_s: float = 3.0,
    header_timeout_s: float = _API.header_timeout_s,
    task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started(BoundAddress)`.

    Use as `address = await nursery.start(serve_api, app, host, port)`.

    `header_timeout_s`: a connection must deliver complete request headers within this long
    after it opens (or after its previous response), or it is closed; an idle kept-alive
    connection is closed after it too. Hypercorn's keep-alive timer is exactly that: it runs
    from the connection's start, or from the end of a response, until a request's headers are
    complete. The body's deadline is the app's (`ApiConfig.body_timeout_s`).
    """
    check_bind(host, requires_api_key=bool(getattr(app.state, "requires_api_key", False)))
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout_s
    config.keep_alive_timeout = header_timeout_s
    config.accesslog = None
    config.errorlog = log
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(_serve_shielded, app, config, shutdown, graceful_timeout_s)
        task_status.started(_address(binds[0], host))
        try:
            await trio.sleep_forever()
        finally:
            # The server runs shielded: cancellation here becomes a graceful shutdown, which
            # hypercorn bounds by its graceful timeout (and `_serve_shielded` by a hard one).
            shutdown.set()


async def _serve_shielded(
    app: Starlette,
    config: Config,
    shutdown: trio.Event,
    graceful_timeout_s: float,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope(shield=True) as scope:

        async def trigger() -> None:
            await shutdown.wait()
            # A last resort in case the graceful path hangs (e.g. a stuck lifespan).
            scope.deadline = trio.current_time() + graceful_timeout_s + 2.0

        await serve(app, config, shutdown_trigger=trigger, task_status=task_status)  # type: ignore[arg-type]


def _address(bind: str, host: str) -> BoundAddress:
    """`http://127.0.0.1:PORT` (hypercorn's form) → BoundAddress."""
    port = int(bind.rsplit(":", 1)[1])
    return BoundAddress(host, port)
