"""`meshd bench lanes`: our lane vs aioquic vs raw UDP, side by side on loopback.

Each contestant runs in this one trio process, driven the same way (a non-blocking socket,
`wait_readable`, the state machine's own timer), so the comparison isolates protocol cost.
Throughput: a stream of 64 KiB messages from one side to the other, timed until the receiver
has them all. Round trip: a 64-byte message echoed back, many times; the median is reported.
Rounds alternate between contestants and the median over rounds is reported, because this
machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import trio

from meshd.bench.harness import print_report
from meshd.net.endpoint import open_endpoint

MESSAGE_BYTES = 64 * 1024
SMALL_BYTES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench lanes`."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="finish in under 30 s")
    parser.add_argument("--messages", type=int, default=None, help="64 KiB messages per round")
    parser.add_argument("--pings", type=int, default=None, help="round trips per round")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table or JSON."""
    messages = args.messages or (200 if args.quick else 1000)
    pings = args.pings or (300 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 3)
    result = trio.run(_main, messages, pings, rounds)
    print_report(result, args.json, _print_table)
    return 0


async def _main(messages: int, pings: int, rounds: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    for _ in range(rounds):
        add("udp_rtt_us", await _udp_rtt_us(pings))
        add("udp_task_hop_rtt_us", await _udp_task_hop_rtt_us(pings))
        mb_s, rtt = await _lane(messages, pings)
        add("lane_mb_s", mb_s)
        add("lane_rtt_us", rtt)
        mb_s, rtt = await _aioquic(messages, pings, max_datagram_bytes=1200)
        add("aioquic_mb_s", mb_s)
        add("aioquic_rtt_us", rtt)
        mb_s, _ = await _aioquic(messages, 0, max_datagram_bytes=16000)
        add("aioquic_max_datagram_mb_s", mb_s)
    out: dict[str, Any] = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    out["throughput_ratio_vs_aioquic"] = round(out["lane_mb_s"] / out["aioquic_mb_s"], 3)
    out["throughput_ratio_vs_aioquic_max_datagram"] = round(
        out["lane_mb_s"] / out["aioquic_max_datagram_mb_s"], 3
    )
    out["rtt_ratio_vs_udp"] = round(out["lane_rtt_us"] / out["udp_rtt_us"], 3)
    out["rtt_ratio_vs_aioquic"] = round(out["lane_rtt_us"] / out["aioquic_rtt_us"], 3)
    out["message_bytes"] = MESSAGE_BYTES
    out["messages"] = messages
    out["pings"] = pings
    out["rounds"] = rounds
    return out


def _print_table(r: dict[str, Any]) -> None:
    print(f"meshd bench lanes — loopback, {r['rounds']} alternating rounds, medians")
    print(f"  throughput, {r['messages']} x 64 KiB messages:")
    print(f"    meshd lane                    {r['lane_mb_s']:9.1f} MB/s")
    print(f"    aioquic (1200 B datagrams)    {r['aioquic_mb_s']:9.1f} MB/s")
    print(f"    aioquic (16000 B datagrams)   {r['aioquic_max_datagram_mb_s']:9.1f} MB/s")
    print(f"    ratio lane / aioquic          {r['throughput_ratio_vs_aioquic']:9.2f}x")
    print(f"  round trip, 64-byte message, {r['pings']} pings:")
    print(f"    raw UDP                       {r['udp_rtt_us']:9.1f} µs")
    print(f"    raw UDP + a task hop per side {r['udp_task_hop_rtt_us']:9.1f} µs")
    print(f"    meshd lane                    {r['lane_rtt_us']:9.1f} µs")
    print(f"    aioquic                       {r['aioquic_rtt_us']:9.1f} µs")
    print(f"    ratio lane / UDP              {r['rtt_ratio_vs_udp']:9.2f}x")
    print(f"    ratio lane / aioquic          {r['rtt_ratio_vs_aioquic']:9.2f}x")


# -- raw UDP floor ---------------------------------------------------------------------------
async def _udp_rtt_us(pings: int) -> float:
    server = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await server.bind(("127.0.0.1", 0))
    await client.bind(("127.0.0.1", 0))
    payload = b"p" * SMALL_BYTES

    async def echo() -> None:
        while True:
            data, addr = await server.recvfrom(2048)
            await server.sendto(data, addr)

    times: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        for _ in range(pings):
            t0 = time.perf_counter()
            await client.sendto(payload, server.getsockname())
            await client.recv(2048)
            times.append(time.perf_counter() - t0)
        nursery.cancel_scope.cancel()
    server.close()
    client.close()
    return statistics.median(times) * 1e6


async def _udp_task_hop_rtt_us(pings: int) -> float:
    """Raw UDP, but each side's reader hands the datagram to another task (as any server
    whose application runs apart from its socket reader does): the scheduling floor."""
    server = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    await server.bind(("127.0.0.1", 0))
    await client.bind(("127.0.0.1", 0))
    to_app, app_inbox = trio.open_memory_channel[tuple[bytes, Any]](64)
    to_client, client_inbox = trio.open_memory_channel[bytes](64)

    async def server_reader() -> None:
        while True:
            await to_app.send(await server.recvfrom(2048))

    async def server_app() -> None:
        async for data, addr in app_inbox:
            await server.sendto(data, addr)

    async def client_reader() -> None:
        while True:
            await to_client.send(await client.recv(2048))

    async with trio.open_nursery() as nursery:
        for task in (server_reader, server_app, client_reader):
            nursery.start_soon(task)
        rtt = await _time_pings(
            lambda d: client.sendto(d, server.getsockname()), client_inbox.receive, pings
        )
        nursery.cancel_scope.cancel()
    server.close()
    client.close()
    return rtt


# -- meshd lane ------------------------------------------------------------------------------
def _keypair() -> tuple[bytes, bytes]:
    from nacl.bindings import crypto_scalarmult_base
    from nacl.utils import random as nacl_random

    private = nacl_random(32)
    return private, crypto_scalarmult_base(private)


async def _lane(messages: int, pings: int) -> tuple[float, float]:
    psk = b"\x07" * 32
    server_priv, server_pub = _keypair()
    client_priv, _ = _keypair()
    payload = b"m" * MESSAGE_BYTES
    async with (
        open_endpoint(static_private=server_priv, psk=psk) as server,
        open_endpoint(static_private=client_priv, psk=psk) as client,
        trio.open_nursery() as nursery,
    ):

        async def serve() -> None:
            lane = await server.accept()
            async for stream_id, data in lane:
                if stream_id == 0:
                    await lane.send(0, data)  # echo small messages
                elif data == b"end":
                    await lane.send(1, b"done")

        nursery.start_soon(serve)
        lane = await client.connect(server.local_address, server_pub)
        rtt = await _time_pings(lambda d: lane.send(0, d), _receive_on(lane, 0), pings)
        t0 = time.perf_counter()
        for _ in range(messages):
            await lane.send(1, payload)
        await lane.send(1, b"end")
        await _receive_on(lane, 1)()
        mb_s = messages * MESSAGE_BYTES / (time.perf_counter() - t0) / 1e6
        lane.close()
        nursery.cancel_scope.cancel()
    return mb_s, rtt


def _receive_on(lane: Any, stream: int) -> Callable[[], Any]:
    async def receive() -> bytes:
        while True:
            stream_id, data = await lane.receive()
            if stream_id == stream:
                return bytes(data)

    return receive


async def _time_pings(send: Callable[[bytes], Any], receive: Callable[[], Any], n: int) -> float:
    payload = b"p" * SMALL_BYTES
    times: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        await send(payload)
        await receive()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 if times else float("nan")


# -- aioquic, driven sans-IO from trio the same way ----------------------------------------
def _self_signed_cert(directory: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = f"{directory}/cert.pem", f"{directory}/key.pem"
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


class _QuicDriver:
    """Drives one aioquic QuicConnection from trio: socket, timer, events."""

    def __init__(
        self,
        conn: Any,
        sock: socket.socket,
        on_event: Callable[[Any], None],
        make_conn: Callable[[bytes], Any] | None = None,
    ) -> None:
        # A server connection is made on its first datagram (it needs the client's CID).
        self.conn = conn
        self.make_conn = make_conn
        self.sock = sock
        self.on_event = on_event
        self.wake = trio.Event()
        self.peer: tuple[str, int] | None = None

    def flush(self) -> None:
        if self.conn is None:
            return
        for data, addr in self.conn.datagrams_to_send(now=trio.current_time()):
            with contextlib.suppress(BlockingIOError, OSError):
                self.sock.sendto(data, addr)
        self.wake.set()

    def _events(self) -> None:
        while (event := self.conn.next_event()) is not None:
            self.on_event(event)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._timer_loop)

    async def _receive_loop(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            now = trio.current_time()
            for _ in range(64):
                try:
                    data, addr = self.sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if self.conn is None:
                    assert self.make_conn is not None
                    self.conn = self.make_conn(data)
                self.conn.receive_datagram(data, addr, now=now)
            self._events()
            self.flush()

    async def _timer_loop(self) -> None:
        while True:
            self.wake = trio.Event()
            timer = self.conn.get_timer() if self.conn is not None else None
            with trio.move_on_at(timer if timer is not None else float("inf")):
                await self.wake.wait()
            now = trio.current_time()
            if timer is not None and now >= timer:
                self.conn.handle_timer(now=now)
                self._events()
                self.flush()


@dataclasses.dataclass
class _QuicBench:
    """One aioquic contestant's state: its two drivers, the server's echo inbox, and the
    events its handlers set for the timing loop."""

    total: int  # bulk bytes the server counts before it answers "done"
    echo_recv: trio.MemoryReceiveChannel[bytes]
    echo_ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    bulk_done: trio.Event = dataclasses.field(default_factory=trio.Event)
    connected: trio.Event = dataclasses.field(default_factory=trio.Event)
    server: _QuicDriver = dataclasses.field(init=False)
    client: _QuicDriver = dataclasses.field(init=False)

    async def echo(self) -> None:
        async for data in self.echo_recv:
            self.server.conn.send_stream_data(0, data)
            self.server.flush()


async def _aioquic(messages: int, pings: int, *, max_datagram_bytes: int) -> tuple[float, float]:
    from aioquic.buffer import Buffer  # type: ignore[attr-defined]
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import HandshakeCompleted, StreamDataReceived
    from aioquic.quic.packet import pull_quic_header

    server_cfg, client_cfg = _quic_configs(max_datagram_bytes)
    server_sock = _udp_socket()
    client_sock = _udp_socket()
    server_addr = server_sock.getsockname()
    # The echo runs in its own task, as the lane's does: same number of task switches.
    echo_send, echo_recv = trio.open_memory_channel[bytes](1024)
    bench = _QuicBench(messages * MESSAGE_BYTES, echo_recv)
    echo_buf = bytearray()
    bulk_received = 0

    def on_server(event: Any) -> None:
        nonlocal bulk_received
        if isinstance(event, StreamDataReceived):
            if event.stream_id == 0:
                echo_send.send_nowait(event.data)
            else:
                bulk_received += len(event.data)
                if bulk_received >= bench.total:
                    bench.server.conn.send_stream_data(event.stream_id, b"done")

    def on_client(event: Any) -> None:
        if isinstance(event, HandshakeCompleted):
            bench.connected.set()
        if isinstance(event, StreamDataReceived):
            if event.stream_id == 0:
                echo_buf.extend(event.data)
                if len(echo_buf) >= SMALL_BYTES:
                    echo_buf.clear()
                    bench.echo_ready.set()
            elif event.data.endswith(b"done"):
                bench.bulk_done.set()

    def make_server_conn(first_datagram: bytes) -> Any:
        header = pull_quic_header(Buffer(data=first_datagram), host_cid_length=8)
        return QuicConnection(
            configuration=server_cfg, original_destination_connection_id=header.destination_cid
        )

    client_conn = QuicConnection(configuration=client_cfg)
    bench.server = _QuicDriver(None, server_sock, on_server, make_server_conn)
    bench.client = _QuicDriver(client_conn, client_sock, on_client)
    try:
        return await _quic_exchange(bench, server_addr, messages, pings)
    finally:
        server_sock.close()
        client_sock.close()


def _quic_configs(max_datagram_bytes: int) -> tuple[Any, Any]:
    """The server's configuration (a fresh self-signed certificate) and the client's."""
    from aioquic.quic.configuration import QuicConfiguration

    def config(is_client: bool) -> Any:
        window = 16 * 1024 * 1024
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=["bench"],
            max_datagram_size=max_datagram_bytes,
            max_data=window,
            max_stream_data=window,
        )

    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _self_signed_cert(tmp)
        server_cfg = config(is_client=False)
        server_cfg.load_cert_chain(cert, key)
    client_cfg = config(is_client=True)
    client_cfg.verify_mode = 0  # ssl.CERT_NONE: self-signed
    return server_cfg, client_cfg


async def _quic_exchange(
    bench: _QuicBench, server_addr: Any, messages: int, pings: int
) -> tuple[float, float]:
    """Connect, time `pings` echoes, then `messages` 64 KiB messages on one stream."""
    client, client_conn = bench.client, bench.client.conn
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bench.server.run)
        nursery.start_soon(bench.echo)
        nursery.start_soon(client.run)
        client_conn.connect(server_addr, now=trio.current_time())
        client.flush()

        async def send_ping(data: bytes) -> None:
            bench.echo_ready = trio.Event()
            client_conn.send_stream_data(0, data)
            client.flush()

        async def wait_echo() -> None:
            await bench.echo_ready.wait()

        rtt = await _time_pings(send_ping, wait_echo, pings) if pings else float("nan")
        bulk = 4  # stream 0 is the echo stream
        await bench.connected.wait()
        payload = b"m" * MESSAGE_BYTES
        t0 = time.perf_counter()
        for _ in range(messages):
            client_conn.send_stream_data(bulk, payload)
            client.flush()
            await trio.lowlevel.checkpoint()
        await bench.bulk_done.wait()
        mb_s = bench.total / (time.perf_counter() - t0) / 1e6
        nursery.cancel_scope.cancel()
    return mb_s, rtt


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
    sock.bind(("127.0.0.1", 0))
    return sock
