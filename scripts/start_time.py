#!/usr/bin/env python3
"""Time from `meshd serve` start to its first chat answer: fresh state dir, then a restart.

    python scripts/start_time.py MODEL [MODEL ...] [--rounds 3] [--port 18230] [--tree DIR ...]

Each round starts the daemon on a new, empty state dir (`fresh`: the tensor hashes of the
model id are computed), stops it, and starts it again on the same state dir (`restart`: the
hashes are cached). `--tree DIR` (repeatable) runs the meshd of another checkout (its `meshd`
package first on PYTHONPATH) as a further contestant, e.g. an export of the commit before a
change: trees and models alternate within a round, so a change in the machine's load falls on
every contestant alike. The clock runs from the process start to the first 200 answer of a 16-token
chat completion (polled every 0.2 s); the daemon's RSS is read then. Prints each run, then the
medians and the load average at the start and end. The daemon's log of the last run of each
kind is in $TMPDIR/meshd-start-PORT-{fresh,restart}.log. `--phases` also prints each log line
of every run as seconds from the process start, and the seconds of a second, identical
request (the first answer's cost beyond a warm daemon's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

BODY = {
    "model": "x",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
}


def phases(log: pathlib.Path, started_unix: float) -> list[str]:
    """The daemon's text log lines as "+S.SS s message", seconds from the process start."""
    out = []
    for line in log.read_text().splitlines():
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        offset = stamp.timestamp() - started_unix
        out.append(f"    +{offset:6.2f} s {line[24:][:150]}")
    return out


def first_answer(
    model: str,
    port: int,
    state: pathlib.Path,
    log: pathlib.Path,
    tree: str,
    show_phases: bool = False,
) -> tuple[float, str]:
    """Seconds from `meshd serve` start to its first answer, and its RSS then."""
    env = dict(os.environ)
    if tree:
        tree = str(pathlib.Path(tree).resolve())
        env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])])
    command = [
        sys.executable, "-m", "meshd.cli.main", "serve", "--model", model,
        "--state-dir", str(state), "--mesh-secret", "x" * 32,
        "--listen-host", "127.0.0.1", "--listen-port", str(port + 1),
        "--api-port", str(port), "--no-mdns-enabled",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = dict(BODY)
    t0 = time.monotonic()
    started_unix = time.time()
    with log.open("w") as err:
        # `python -m` puts the working directory first on sys.path: run in the tree timed.
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tree or None
        )
    try:
        while True:
            try:
                reply = httpx.post(url, json=body, timeout=120)
                if reply.status_code == 200:
                    break
                if reply.status_code == 404:
                    models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
                    body["model"] = models["data"][0]["id"]
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise SystemExit(f"meshd serve exited {process.returncode}: see {log}")
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        if show_phases:
            t1 = time.monotonic()
            httpx.post(url, json=body, timeout=120).raise_for_status()
            print(f"  second request: {time.monotonic() - t1:.2f} s")
            print("\n".join(phases(log, started_unix)))
        with open(f"/proc/{process.pid}/status") as f:
            rss = " ".join(
                "".join(line.split()[:2])
                for line in f
                if line.startswith(("VmRSS", "RssAnon", "RssFile"))
            )
        return elapsed, rss
    finally:
        process.terminate()
        process.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18230)
    parser.add_argument("--tree", action="append", default=[], help="another checkout to time")
    parser.add_argument("--phases", action="store_true", help="print the daemon's log timed")
    args = parser.parse_args()
    trees = ["", *args.tree]  # "": the meshd this Python imports
    times: dict[tuple[str, str, str], list[float]] = {}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for round_no in range(args.rounds):
        for tree in trees:
            for model in args.models:
                state = pathlib.Path(tempfile.mkdtemp(prefix="meshd-start-"))
                try:
                    for kind in ("fresh", "restart"):
                        log = pathlib.Path(tempfile.gettempdir()) / (
                            f"meshd-start-{args.port}-{kind}.log"
                        )
                        seconds, rss = first_answer(model, args.port, state, log, tree, args.phases)
                        times.setdefault((tree, model, kind), []).append(seconds)
                        name = f"{tree or 'this meshd'}: {pathlib.Path(model).name}"
                        print(f"round {round_no + 1} {name} {kind}: {seconds:.2f} s, {rss}")
                        print(f"  load average {os.getloadavg()[0]:.2f}", flush=True)
                finally:
                    shutil.rmtree(state, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for (tree, model, kind), values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        name = f"{tree or 'this meshd'}: {pathlib.Path(model).name}"
        print(f"{name} {kind}: median {statistics.median(values):.2f} s ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
