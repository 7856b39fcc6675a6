"""A real API over a real pipeline, shared by a test module.

pytest-trio runs each async test in its own trio run, so a pipeline cannot outlive one test
there. The shared server instead lives in a background thread with its own trio run: a
2-stage loopback pipeline on the built-in model (real lanes, real stage hosts), served by
five apps: open, keyed (API key required), one whose backend admits a single request at
a time (for 429), one with short header and body timeouts (EDGE_*_TIMEOUT_S), and a keyed
one that allows a web origin and a host name (CORS_ORIGIN, ALLOWED_HOST). Tests talk to it over HTTP from plain (sync) test functions, and reach into
its trio run with `Served.call` / `Served.acall`.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.backend import LocalPipelineBackend, open_local_backend
from meshd.api.openai import ApiConfig, create_app
from meshd.api.server import BoundAddress, serve_api

API_KEY = "test-key-5f1c"
EDGE_HEADER_TIMEOUT_S = 1.0
EDGE_BODY_TIMEOUT_S = 1.5
MODEL = "meshd-builtin"
CORS_ORIGIN = "https://app.example.com"
ALLOWED_HOST = "mesh.example.com"
T = TypeVar("T")


@dataclass
class Served:
    """The shared server: base URLs, the backend, and a way into its trio run."""

    url: str
    keyed_url: str
    single_url: str
    backend: LocalPipelineBackend
    token: trio.lowlevel.TrioToken
    edge_url: str = ""  # the app with short header and body timeouts
    cors_url: str = ""  # the keyed app with CORS_ORIGIN and ALLOWED_HOST allowed

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a sync function inside the server's trio run."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def acall(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run an async function inside the server's trio run."""
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def sessions_open(self) -> list[int]:
        """KV sessions open on each stage host."""
        return self.call(lambda: [h.stats.sessions_open for h in self.backend.pipeline.hosts])

    def metrics(
        self, url: str | None = None, headers: dict[str, str] | None = None
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of `/metrics`, keyed by (name, sorted labels)."""
        root = (url or self.url).removesuffix("/v1")
        text = httpx.get(f"{root}/metrics", headers=headers, timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def _serve(out: queue.Queue[Any]) -> None:
    async def main() -> None:
        async with open_local_backend(stages=2) as backend:
            single = LocalPipelineBackend(
                backend.pipeline, backend.tokenizer, model_name=MODEL, max_concurrent_requests=1
            )
            apps = [create_app(backend), create_app(backend, api_key=API_KEY), create_app(single)]
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                addresses: list[BoundAddress] = [await nursery.start(serve_api, a) for a in apps]
                edge = create_app(backend, config=ApiConfig(body_timeout_s=EDGE_BODY_TIMEOUT_S))
                serve_edge = functools.partial(serve_api, header_timeout_s=EDGE_HEADER_TIMEOUT_S)
                addresses.append(await nursery.start(serve_edge, edge))
                allowing = ApiConfig(allowed_hosts=(ALLOWED_HOST,), cors_origins=(CORS_ORIGIN,))
                cors = create_app(backend, api_key=API_KEY, config=allowing)
                addresses.append(await nursery.start(serve_api, cors))
                out.put((addresses, backend, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException as exc:
        out.put(exc)
        raise


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    out: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=_serve, args=(out,), name="api-server", daemon=True)
    thread.start()
    got = out.get(timeout=60)
    if isinstance(got, BaseException):
        raise got
    addresses, backend, token, stop = got
    try:
        open_app, keyed_app, single_app, edge_app, cors_app = addresses
        yield Served(
            open_app.base_url,
            keyed_app.base_url,
            single_app.base_url,
            backend,
            token,
            edge_url=edge_app.base_url,
            cors_url=cors_app.base_url,
        )
    finally:
        token.run_sync_soon(stop.set)
        thread.join(timeout=15)
        assert not thread.is_alive(), "the API server did not shut down"
