#!/usr/bin/env python3
"""Memory of `meshd serve` daemons holding a GGUF file: one alone, or a 2-stage mesh on this
machine (two daemons on 127.0.0.1, the second joining the first).

    python scripts/serve_memory.py MODEL [--nodes 1|2] [--budget BYTES] [--context 4096]

Each daemon gets a fresh state dir, `--context-tokens CONTEXT` and, with `--budget`, that
memory budget (pick one under the whole model's bytes and the planner splits it over the two
nodes). Once the first node answers a 16-token chat completion, each daemon's memory is read
from /proc/PID/smaps_rollup: `Rss`, `Anonymous` (the process's own: Python, torch, tokenizer,
KV cache, scratch) and the rest (file pages: the mapped GGUF ranges and the libraries), with
the stage each loaded (its log line: layers and weight bytes). Prints one line per node and
the load average.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
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
SECRET = "x" * 32
STAGE_LINE = re.compile(r"stage loaded: layers \[(\d+), (\d+)\) .*?, (\d+) weight bytes")


def start(
    model: str, state: pathlib.Path, port: int, log: pathlib.Path, extra: list[str]
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "meshd.cli.main", "serve", "--model", model,
        "--state-dir", str(state), "--mesh-secret", SECRET,
        "--listen-host", "127.0.0.1", "--listen-port", str(port + 1),
        "--api-port", str(port), "--no-mdns-enabled", *extra,
    ]  # fmt: skip
    with log.open("w") as err:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)


def answer(port: int, processes: list[subprocess.Popen[bytes]], logs: list[pathlib.Path]) -> None:
    """Poll node 0's API until a chat completion is answered (200)."""
    body = dict(BODY)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for process, log in zip(processes, logs, strict=True):
            if process.poll() is not None:
                raise SystemExit(f"meshd serve exited {process.returncode}: see {log}")
        try:
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            if reply.status_code == 200:
                return
            if reply.status_code == 404:
                body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("no answer within 600 s")


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in kB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--budget", type=int, default=0, help="memory_budget_bytes per node")
    parser.add_argument("--context", type=int, default=4096, help="context_tokens")
    parser.add_argument("--port", type=int, default=18330)
    args = parser.parse_args()
    extra = ["--context-tokens", str(args.context)]
    if args.budget:
        extra += ["--memory-budget-bytes", str(args.budget)]
    root = pathlib.Path(tempfile.mkdtemp(prefix="meshd-memory-"))
    processes: list[subprocess.Popen[bytes]] = []
    logs = [root / f"node{i}.log" for i in range(args.nodes)]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        for i in range(args.nodes):
            port = args.port + 10 * i
            join = ["--join", f"127.0.0.1:{args.port + 1}"] if i else []
            processes.append(start(args.model, root / f"state{i}", port, logs[i], extra + join))
        answer(args.port, processes, logs)
        time.sleep(1)  # the answer's scratch freed
        size = pathlib.Path(args.model).stat().st_size
        print(f"{pathlib.Path(args.model).name}: {size / 1e6:.0f} MB, {args.nodes} node(s)")
        for i, (process, log) in enumerate(zip(processes, logs, strict=True)):
            mem = rollup(process.pid)
            stages = STAGE_LINE.findall(log.read_text())
            stage = (
                f"layers [{stages[-1][0]}, {stages[-1][1]}), {int(stages[-1][2]) / 1e6:.0f} MB "
                "of weights"
                if stages
                else "no stage"
            )
            anon, rss = mem["Anonymous"], mem["Rss"]
            print(
                f"node {i}: {stage}; Rss {rss / 1024:.0f} MiB = anonymous {anon / 1024:.0f} "
                f"MiB + file-backed {(rss - anon) / 1024:.0f} MiB"
            )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
