"""The slow-body attack on the HTTP API, measured: who closes, what /metrics counts, the log.

    python scripts/slow_body.py                       # 300 connections at 1 byte/s, 30 s
    python scripts/slow_body.py --conns 50 --duration 12 --body-timeout 5 --header-timeout 3

Serves the API of a 1-stage local pipeline (the built-in model) on 127.0.0.1, opens `--conns`
connections (`--stagger` s apart) that each send the headers of a POST with `Content-Length: 100000` and then one
body byte per `1/--rate` s, plus `--idle` connections that send nothing. A connection the
server closes is noted with the time since it connected; the rest hang up at `--duration`. Then it
prints one JSON object: connections closed by the server (and within how long), the statuses
`/metrics` counted, and the log's line and traceback counts (the log goes to `--log`).
`--header-timeout` goes to `serve_api`, `--body-timeout` to the app's `ApiConfig` (when they
take them, so the script also measures the code before them).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from inspect import signature
from typing import Any, TextIO

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from meshd.api.backend import open_local_backend
from meshd.api.openai import ApiConfig, create_app
from meshd.api.server import serve_api
from meshd.logging_setup import setup_logging

HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
)


async def _attacker(
    port: int, rate: float, duration: float, send_headers: bool, closed: list[float]
) -> None:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    started = trio.current_time()  # the timeouts run from here (headers go out at once)
    async with stream:
        with trio.move_on_at(started + duration):
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    try:
                        while await stream.receive_some(65536):
                            pass
                    except trio.BrokenResourceError:
                        pass
                    closed.append(trio.current_time() - started)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                try:
                    if send_headers:
                        await stream.send_all(HEADERS)
                        while True:
                            await trio.sleep(1 / rate)
                            await stream.send_all(b" ")
                    else:
                        await trio.sleep_forever()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await trio.sleep_forever()  # `watch` notes the close


def _statuses(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "meshd_api_requests_total" and s.labels["route"] != "/metrics":
                out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


async def main(args: argparse.Namespace, log_file: TextIO) -> dict[str, Any]:
    setup_logging("info", "text", stream=log_file)
    kwargs: dict[str, float] = {}
    if args.header_timeout is not None and "header_timeout_s" in signature(serve_api).parameters:
        kwargs["header_timeout_s"] = args.header_timeout
    app_kwargs: dict[str, Any] = {}
    if args.body_timeout is not None and "body_timeout_s" in ApiConfig.__struct_fields__:
        app_kwargs["config"] = ApiConfig(body_timeout_s=args.body_timeout)  # type: ignore[call-arg]
    closed_body: list[float] = []
    closed_idle: list[float] = []
    async with open_local_backend(stages=1) as backend, trio.open_nursery() as nursery:
        address = await nursery.start(lambda task_status: serve_api(
            create_app(backend, **app_kwargs), "127.0.0.1", 0, task_status=task_status, **kwargs
        ))  # fmt: skip
        t0 = time.perf_counter()
        async with trio.open_nursery() as attack:
            for _ in range(args.conns):
                attack.start_soon(
                    _attacker, address.port, args.rate, args.duration, True, closed_body
                )
                await trio.sleep(args.stagger)  # a burst beyond the listen backlog gets resets
            for _ in range(args.idle):
                attack.start_soon(
                    _attacker, address.port, args.rate, args.duration, False, closed_idle
                )
        attack_s = time.perf_counter() - t0
        # Let the server notice the hang-ups before counting.
        await trio.sleep(args.settle)
        statuses = await trio.to_thread.run_sync(_statuses, address.port)
        nursery.cancel_scope.cancel()
    logging.getLogger().handlers.clear()

    def closes(times: list[float]) -> dict[str, Any]:
        return {
            "closed_by_server": len(times),
            "closed_within_s_median": round(statistics.median(times), 2) if times else None,
            "closed_within_s_max": round(max(times), 2) if times else None,
        }

    return {
        "conns": args.conns,
        "idle_conns": args.idle,
        "rate_bytes_per_s": args.rate,
        "duration_s": args.duration,
        "header_timeout_s": kwargs.get("header_timeout_s"),
        "body_timeout_s": args.body_timeout if app_kwargs else None,
        "attack_wall_s": round(attack_s, 1),
        "slow_body": closes(closed_body),
        "idle": closes(closed_idle),
        "statuses_counted": statuses,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conns", type=int, default=300)
    parser.add_argument("--idle", type=int, default=0)
    parser.add_argument("--rate", type=float, default=1.0, help="body bytes per second")
    parser.add_argument("--duration", type=float, default=30.0, help="hang up after (s)")
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--stagger", type=float, default=0.01, help="between connections (s)")
    parser.add_argument("--header-timeout", type=float, default=None)
    parser.add_argument("--body-timeout", type=float, default=None)
    parser.add_argument("--log", default="/tmp/slow_body.log")
    args = parser.parse_args()
    with open(args.log, "w") as log_file:
        report = trio.run(main, args, log_file)
    with open(args.log) as log_file:
        text = log_file.read()
    report["log_lines"] = text.count("\n")
    report["log_tracebacks"] = text.count("Traceback")
    report["log_error_lines"] = sum(1 for line in text.splitlines() if " ERROR " in line)
    print(json.dumps(report, indent=2))
