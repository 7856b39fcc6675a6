"""A loopback TCP proxy that delays every byte by a fixed one-way time, in both directions.

llama.cpp's RPC client talks TCP to `rpc-server`; putting this proxy between them gives the
link a round trip of 2 × `one_way_s` (plus loopback's own), the way meshd's `--rtt-ms` delays
what each node's UDP endpoint sends by RTT/2. A delay, not a bandwidth cap: each chunk read is
written out `one_way_s` after it arrived, in order, however much else is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

_CHUNK = 1 << 16


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, one_way_s: float
) -> None:
    """Copy reader → writer, each chunk released `one_way_s` after it was read."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    sender = asyncio.create_task(release())
    try:
        while True:
            data = await reader.read(_CHUNK)
            queue.put_nowait((time.monotonic() + one_way_s, data))
            if not data:
                break
        await sender
    except (ConnectionError, asyncio.CancelledError):
        sender.cancel()
        raise


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def serve(
    listen_port: int, target_port: int, one_way_s: float, ready: threading.Event
) -> None:
    """Accept on 127.0.0.1:listen_port, forward each connection to 127.0.0.1:target_port."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_w.close()
            return
        _no_delay(client_w)
        _no_delay(server_w)
        # Cancellation here means the proxy is shutting down: end the connection quietly
        # (asyncio logs a connection task that ends cancelled as an error).
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await asyncio.gather(
                _pump(client_r, server_w, one_way_s), _pump(server_r, client_w, one_way_s)
            )
        for w in (client_w, server_w):
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    ready.set()
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def delay_proxy(target_port: int, one_way_s: float) -> Iterator[int]:
    """Run the proxy in a daemon thread for the `with` block; yields the port it listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    ready = threading.Event()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]] = []

    async def runner() -> None:
        this = asyncio.current_task()
        assert this is not None
        running.append((asyncio.get_running_loop(), this))
        await serve(port, target_port, one_way_s, ready)

    def main() -> None:
        # asyncio.run cancels the per-connection tasks too when the server task ends.
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(runner())

    thread = threading.Thread(target=main, name="delay-proxy", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("delay proxy did not start")
    try:
        yield port
    finally:
        loop, task = running[0]
        loop.call_soon_threadsafe(task.cancel)
        thread.join(5)
