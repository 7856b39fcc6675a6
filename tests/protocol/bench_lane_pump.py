"""Protocol cost of a lane without sockets: two lanes handing datagrams straight to each other.

    python -m tests.protocol.bench_lane_pump [--messages 2000] [--round-trips 5000] [--repeats 5]

Reports bulk throughput of 64 KiB messages (MB/s and µs of both sides' CPU per message) and the
CPU cost of one 64-byte request/response round trip. Everything runs in one thread on a
virtual clock, so the figures are pure protocol work (AEAD included); the best of `repeats`
runs is reported, measured as process CPU time, because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import time

from protocol.lane import Lane, MessageReceived
from tests.protocol.lane_sim import LinkProfile, pair

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    best_bulk = min(bulk(args.messages) for _ in range(args.repeats))
    best_rtt = min(round_trips(args.round_trips) for _ in range(args.repeats))
    mb_s = args.messages * MESSAGE_BYTES / best_bulk / 1e6
    print(
        f"bulk 64 KiB: {mb_s:.0f} MB/s, {best_bulk / args.messages * 1e6:.1f} us per message "
        f"(sender + receiver CPU, best of {args.repeats})"
    )
    print(
        f"64 B round trip: {best_rtt / args.round_trips * 1e6:.1f} us of protocol CPU "
        f"(two messages, both lanes, best of {args.repeats})"
    )


if __name__ == "__main__":
    main()
