"""Protocol cost of a lane without sockets: two lanes handing datagrams straight to each other.

    python -m meshd.bench.lane_pump [--messages 2000] [--round-trips 5000] [--repeats 5]

Reports bulk throughput of 64 KiB messages (MB/s and µs of both sides' CPU per message) and the
CPU cost of one 64-byte request/response round trip, for a lane and, side by side, for
aioquic's sans-IO `QuicConnection` pumped the same way (ChaCha20-Poly1305 like the lane;
16000-byte datagrams, the largest aioquic 1.7 handled here: at 32000 it stalled and at 65000
its peer failed to parse STREAM frames). Everything runs in one thread on a
virtual clock, so the figures are pure protocol work (AEAD included); the best of `repeats`
runs is reported, measured as process CPU time, because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import datetime
import ssl
import time
from collections.abc import Callable

from meshd.sim.lane_pair import LinkProfile, pair
from protocol.lane import Lane, MessageReceived

MESSAGE_BYTES = 64 * 1024


def _exchange(a: Lane, b: Lane, now: float) -> tuple[int, float]:
    """Move datagrams both ways until both lanes are quiet; returns (messages at b, now)."""
    received = 0
    moved = True
    while moved:
        moved = False
        for src, dst in ((a, b), (b, a)):
            for data, _ in src.datagrams_to_send(now):
                dst.receive_datagram(data, "peer", now)
                moved = True
            while (event := dst.next_event()) is not None:
                received += isinstance(event, MessageReceived) and dst is b
        now += 1e-5
        for lane in (a, b):
            timer = lane.get_timer()
            if timer is not None and timer <= now:
                lane.handle_timer(now)
    return received, now


def established() -> tuple[Lane, Lane, float]:
    net, a, b = pair(link=LinkProfile(delay_s=0.0001))
    net.run(until=net.now + 0.05)  # PMTU probing reaches 65000-byte datagrams
    return a, b, net.now


def bulk(messages: int) -> float:
    """Seconds of CPU to move `messages` 64 KiB messages from a to b."""
    a, b, now = established()
    payload = bytes(MESSAGE_BYTES)
    sent = received = 0
    start = time.process_time()
    while received < messages:
        while sent < messages and a.pending_send_bytes < 4 * 1024 * 1024:
            a.send_message(1, payload)
            sent += 1
        got, now = _exchange(a, b, now)
        received += got
    return time.process_time() - start


def round_trips(count: int) -> float:
    """Seconds of CPU for `count` 64-byte request/response exchanges."""
    a, b, now = established()
    request = bytes(64)
    start = time.process_time()
    for _ in range(count):
        a.send_message(2, request)
        for data, _ in a.datagrams_to_send(now):
            b.receive_datagram(data, "a", now)
        event = b.next_event()
        assert isinstance(event, MessageReceived)
        b.send_message(2, event.data)
        for data, _ in b.datagrams_to_send(now):
            a.receive_datagram(data, "b", now)
        assert isinstance(a.next_event(), MessageReceived)
        now += 2e-5
        for lane in (a, b):
            timer = lane.get_timer()
            if timer is not None and timer <= now:
                lane.handle_timer(now)
    return time.process_time() - start


# --- aioquic, pumped the same way ---------------------------------------------------------


def _aioquic_pair() -> tuple[object, object, float]:
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.tls import CipherSuite
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    start = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=36500))
        .sign(key, hashes.SHA256())
    )
    common = {
        "alpn_protocols": ["bench"],
        "max_datagram_size": 16000,
        "cipher_suites": [CipherSuite.CHACHA20_POLY1305_SHA256],
        "max_data": 32 * 1024 * 1024,
        "max_stream_data": 8 * 1024 * 1024,
    }
    client_config = QuicConfiguration(is_client=True, verify_mode=ssl.CERT_NONE, **common)  # type: ignore[arg-type]
    server_config = QuicConfiguration(is_client=False, certificate=cert, private_key=key, **common)  # type: ignore[arg-type]
    client = QuicConnection(configuration=client_config)
    server = QuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    now = 1.0
    client.connect(("127.0.0.1", 2), now=now)
    for _ in range(20):
        _quic_exchange(client, server, now, lambda _e: None)
        now += 0.001
    return client, server, now


def _quic_exchange(
    client: object, server: object, now: float, on_event: Callable[[object], None]
) -> None:
    moved = True
    while moved:
        moved = False
        for src, dst, addr in (
            (client, server, ("127.0.0.1", 1)),
            (server, client, ("127.0.0.1", 2)),
        ):
            for data, _ in src.datagrams_to_send(now):  # type: ignore[attr-defined]
                dst.receive_datagram(data, addr, now)  # type: ignore[attr-defined]
                moved = True
            while (event := dst.next_event()) is not None:  # type: ignore[attr-defined]
                on_event(event)
        for conn in (client, server):
            timer = conn.get_timer()  # type: ignore[attr-defined]
            if timer is not None and timer <= now:
                conn.handle_timer(now)  # type: ignore[attr-defined]


def aioquic_bulk(messages: int) -> float:
    """Seconds of CPU for aioquic to move the same bytes on one stream."""
    from aioquic.quic.events import StreamDataReceived

    client, server, now = _aioquic_pair()
    stream = client.get_next_available_stream_id()  # type: ignore[attr-defined]
    payload = bytes(MESSAGE_BYTES)
    total = messages * MESSAGE_BYTES
    received = [0]

    def on_event(event: object) -> None:
        if isinstance(event, StreamDataReceived):
            received[0] += len(event.data)

    start = time.process_time()
    sent = 0
    while received[0] < total:
        while sent < messages and sent * MESSAGE_BYTES - received[0] < 4 * 1024 * 1024:
            client.send_stream_data(stream, payload)  # type: ignore[attr-defined]
            sent += 1
        _quic_exchange(client, server, now, on_event)
        now += 1e-5
    return time.process_time() - start


def aioquic_round_trips(count: int) -> float:
    """Seconds of CPU for `count` 64-byte request/response exchanges over aioquic."""
    from aioquic.quic.events import StreamDataReceived

    client, server, now = _aioquic_pair()
    stream = client.get_next_available_stream_id()  # type: ignore[attr-defined]
    request = bytes(64)
    got: list[tuple[object, bytes]] = []

    def on_event(event: object) -> None:
        if isinstance(event, StreamDataReceived) and event.data:
            got.append((event, event.data))

    start = time.process_time()
    for _ in range(count):
        client.send_stream_data(stream, request)  # type: ignore[attr-defined]
        legs = ((client, server, ("127.0.0.1", 1), True), (server, client, ("127.0.0.1", 2), False))
        for holder, peer, source, reply in legs:
            for _ in range(1000):  # aioquic paces: a datagram may wait a little
                for data, _ in holder.datagrams_to_send(now):  # type: ignore[attr-defined]
                    peer.receive_datagram(data, source, now)  # type: ignore[attr-defined]
                while (event := peer.next_event()) is not None:  # type: ignore[attr-defined]
                    on_event(event)
                if got:
                    break
                now += 1e-5
                for conn in (client, server):
                    timer = conn.get_timer()  # type: ignore[attr-defined]
                    if timer is not None and timer <= now:
                        conn.handle_timer(now)  # type: ignore[attr-defined]
            if reply:
                server.send_stream_data(stream, got.pop()[1])  # type: ignore[attr-defined]
        got.clear()
        now += 2e-5
        for conn in (client, server):
            timer = conn.get_timer()  # type: ignore[attr-defined]
            if timer is not None and timer <= now:
                conn.handle_timer(now)  # type: ignore[attr-defined]
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs = (
        ("lane", bulk, round_trips),
        ("aioquic", aioquic_bulk, aioquic_round_trips),
    )
    for name, bulk_run, rtt_run in runs:
        best_bulk = min(bulk_run(args.messages) for _ in range(args.repeats))
        best_rtt = min(rtt_run(args.round_trips) for _ in range(args.repeats))
        mb_s = args.messages * MESSAGE_BYTES / best_bulk / 1e6
        print(
            f"{name:8s} bulk 64 KiB: {mb_s:4.0f} MB/s, {best_bulk / args.messages * 1e6:6.1f} us "
            f"per message; 64 B round trip: {best_rtt / args.round_trips * 1e6:6.1f} us "
            f"(CPU of both sides, best of {args.repeats})"
        )


if __name__ == "__main__":
    main()
