"""serve_api: loopback unless keyed, and a graceful shutdown when its scope is cancelled."""

from __future__ import annotations

import httpx
import pytest
import trio

from meshd.api.backend import open_local_backend
from meshd.api.openai import create_app
from meshd.api.server import ApiBindError, BoundAddress, check_bind, is_loopback, serve_api
from tests.api.conftest import MODEL


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.4", False), ("example.org", False)],
)  # fmt: skip
def test_only_loopback_binds_without_a_key(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    check_bind(host, requires_api_key=True)  # a key makes any address acceptable
    if loopback:
        check_bind(host, requires_api_key=False)
    else:
        with pytest.raises(ApiBindError, match="not a loopback address"):
            check_bind(host, requires_api_key=False)


async def test_non_loopback_bind_without_key_is_refused_at_startup() -> None:
    async with open_local_backend(stages=1) as backend:
        app = create_app(backend)
        with pytest.raises(ApiBindError), trio.fail_after(5):
            await serve_api(app, "0.0.0.0", 0)  # raises before binding anything


async def test_cancellation_lets_a_running_stream_finish_then_stops() -> None:
    body = {
        "model": MODEL,
        "prompt": "def fibonacci(n):\n",
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "meshd": {"ignore_eos": True},
    }
    async with open_local_backend(stages=1) as backend:
        app = create_app(backend)
        stopped = trio.Event()
        server_scope = trio.CancelScope()

        async def run_server(task_status: trio.TaskStatus[BoundAddress]) -> None:
            with server_scope:
                await serve_api(app, graceful_timeout_s=10.0, task_status=task_status)
            stopped.set()

        async with trio.open_nursery() as nursery:
            address = await nursery.start(run_server)
            url = address.base_url
            with trio.fail_after(30):
                async with httpx.AsyncClient(timeout=30) as client:
                    async with client.stream("POST", f"{url}/completions", json=body) as response:
                        lines = response.aiter_lines()
                        first = await lines.__anext__()
                        server_scope.cancel()  # shut down while the stream is running
                        rest = [line async for line in lines if line]
                    await stopped.wait()
                    with pytest.raises(httpx.ConnectError):
                        await client.get(f"{url}/models")
    assert first.startswith("data: {")
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]
