"""The HTTP edge under hostile clients: slow bodies, slow or no headers, hang-ups.

Raw sockets against the shared server's `edge` app (1 s header, 1.5 s body timeout).
"""

from __future__ import annotations

import logging
import select
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.api.conftest import EDGE_BODY_TIMEOUT_S, EDGE_HEADER_TIMEOUT_S, Served
from tests.api.test_http import wait_until

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
)
CHAT = "/v1/chat/completions"
SLACK_S = 1.0  # scheduling on a loaded 2-core machine


def connect(served: Served) -> socket.socket:
    url = urlsplit(served.edge_url)
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=5)


def trickle_until_closed(
    sock: socket.socket, data: bytes, period_s: float, limit_s: float
) -> tuple[float, bytes]:
    """Send `data` a byte per `period_s` until the server closes: (seconds taken, bytes read)."""
    started = time.monotonic()
    received = b""
    for i in range(len(data) + 1):
        try:
            if i < len(data):
                sock.sendall(data[i : i + 1])
            deadline = time.monotonic() + period_s
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([sock], [], [], left)[0]:
                    break
                chunk = sock.recv(65536)
                if not chunk:
                    return time.monotonic() - started, received
                received += chunk
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started, received
        assert time.monotonic() - started < limit_s, "the server kept the connection open"
    raise AssertionError("ran out of bytes to send before the server closed")


def wait_closed(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Wait, sending nothing, until the server closes: (seconds taken, bytes read)."""
    started = time.monotonic()
    received = b""
    while (left := started + limit_s - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return time.monotonic() - started, received
            received += chunk
    raise AssertionError("the server kept the connection open")


def requests_counted(served: Served, status: str) -> float:
    key = ("meshd_api_requests_total", (("route", CHAT), ("status", status)))
    return served.metrics(served.edge_url).get(key, 0.0)


def test_slow_body_gets_408_and_is_closed_within_the_body_timeout(served: Served) -> None:
    before = requests_counted(served, "408")
    with connect(served) as sock:
        sock.sendall(HEAD)
        took_s, answer = trickle_until_closed(
            sock, b" " * 1000, period_s=0.2, limit_s=EDGE_BODY_TIMEOUT_S + SLACK_S
        )
    assert EDGE_BODY_TIMEOUT_S - 0.3 < took_s < EDGE_BODY_TIMEOUT_S + SLACK_S
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in answer and b"connection: close" in answer.lower()
    assert requests_counted(served, "408") == before + 1


def test_idle_connection_is_closed_within_the_header_timeout(served: Served) -> None:
    with connect(served) as sock:
        took_s, answer = wait_closed(sock, EDGE_HEADER_TIMEOUT_S + SLACK_S)
    assert took_s > EDGE_HEADER_TIMEOUT_S - 0.3 and answer == b""


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout(served: Served) -> None:
    with connect(served) as sock:
        took_s, _ = trickle_until_closed(
            sock, HEAD, period_s=0.1, limit_s=EDGE_HEADER_TIMEOUT_S + SLACK_S
        )
    assert took_s > EDGE_HEADER_TIMEOUT_S - 0.3


def test_a_kept_alive_connection_serves_again_then_idles_out(served: Served) -> None:
    get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(served) as sock:
        for _ in range(2):
            sock.sendall(get)
            answer = b""
            while b'"object":"list"' not in answer:
                chunk = sock.recv(65536)
                assert chunk, "closed while a request was being answered"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ")
        took_s, _ = wait_closed(sock, EDGE_HEADER_TIMEOUT_S + SLACK_S)
    assert took_s > EDGE_HEADER_TIMEOUT_S - 0.3


def test_clients_hanging_up_mid_body_count_as_499_once_in_one_log_line_each(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    before_499, before_500 = requests_counted(served, "499"), requests_counted(served, "500")
    ports = []
    for _ in range(3):
        with connect(served) as sock:
            sock.sendall(HEAD + b'{"model": "x", ')
            ports.append(sock.getsockname()[1])
    wait_until(lambda: requests_counted(served, "499") == before_499 + 3)
    # Counted once each: a later request's count shows nothing more was added meanwhile.
    with connect(served) as sock:
        sock.sendall(HEAD + b"{")
    wait_until(lambda: requests_counted(served, "499") == before_499 + 4)
    assert requests_counted(served, "500") == before_500
    for port in ports:
        lines = [r for r in caplog.records if f":{port} " in r.getMessage()]
        assert len(lines) == 1, lines
        assert "went away" in lines[0].getMessage() and "499" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
