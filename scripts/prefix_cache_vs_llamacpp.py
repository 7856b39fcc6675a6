"""Time to first token of a multi-turn chat: meshd daemons against llama-server, side by side.

    python scripts/prefix_cache_vs_llamacpp.py [--model FILE.gguf] [--stages 1|2] [--rounds N]

Starts llama-server (built by scripts/bench_llamacpp/llama_server.py; `--jinja`, one slot,
`cache_prompt` on, as it is by default) and `--stages` meshd daemons on 127.0.0.x serving the
same GGUF file, then runs the chat of scripts/prefix_cache_chat.py (a long system prompt, short
questions, each reply appended as the assistant's message) through the official `openai`
client, streamed and greedy. Each turn's messages go to both servers, one after the other,
in alternating order, and the reply appended is meshd's, so both see the same conversation.
TTFT: request sent to the first chunk with text. A round starts from another system prompt
(a cold first turn on both). Prints per turn the prompt tokens (llama-server's count), meshd's
cached tokens, the median TTFTs and their ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import openai

from meshd.cli.supervisor import (
    LoopbackDaemon,
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
    write_secret_file,
)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "bench_llamacpp"))
sys.path.insert(0, str(HERE))

from llama_server import ensure_server  # noqa: E402
from prefix_cache_chat import QUESTIONS, SYSTEM_SOURCE  # noqa: E402

DEFAULT = "~/.cache/meshd/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
LLAMA_PORT = 18093


def ttft(client: openai.OpenAI, messages: list[Any], max_tokens: int) -> tuple[float, str, Any]:
    """(seconds to the first text, the reply, the usage) of one streamed greedy request."""
    started_at = time.perf_counter()
    first = float("nan")
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            if not parts:
                first = time.perf_counter() - started_at
            parts.append(chunk.choices[0].delta.content)
    return first, "".join(parts), usage


def start_llama(model: str, threads: int, repack: bool) -> subprocess.Popen[bytes]:
    binary = ensure_server()
    cmd = [
        str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(LLAMA_PORT),
        "-t", str(threads), "-c", "4096", "-np", "1", "--jinja", "--no-webui",
    ]  # fmt: skip
    if not repack:  # AMX tiles fault in this VM for batches > 1 (prefill)
        cmd.append("--no-repack")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{LLAMA_PORT}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}")
        time.sleep(1)
    proc.kill()
    raise SystemExit("llama-server did not come up in 300 s")


def start_meshd(work: pathlib.Path, model: str, stages: int, threads: int) -> list[Any]:
    secret = write_secret_file(work / "mesh.secret", "vs-llamacpp-" + os.urandom(8).hex())
    budget = stage_budget(model, stages) if stages > 1 else 2 << 30
    daemons = [
        LoopbackDaemon(work, f"n{i}", f"127.0.0.{i}", secret, budget, model,
                       extra=("--threads", str(threads)))
        for i in range(40, 40 + stages)
    ]  # fmt: skip
    started(daemons, timeout_s=600)
    wait_until(lambda: settled_plan(daemons) is not None, 600, "a settled plan")
    return daemons


def chat(args: argparse.Namespace, meshd_url: str) -> None:
    clients = {
        "meshd": openai.OpenAI(base_url=meshd_url, api_key="x", timeout=1800, max_retries=0),
        "llama": openai.OpenAI(
            base_url=f"http://127.0.0.1:{LLAMA_PORT}/v1", api_key="x", timeout=1800
        ),
    }
    source = SYSTEM_SOURCE.read_text()
    times: dict[tuple[str, int], list[float]] = {}
    rows: dict[int, tuple[int, int]] = {}
    for round_ in range(args.rounds):
        start = round_ * 997  # another system prompt each round: a cold first turn
        messages: list[Any] = [
            {"role": "system", "content": source[start : start + args.system_chars]}
        ]
        for index in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
            order = ["meshd", "llama"] if (round_ + index) % 2 == 0 else ["llama", "meshd"]
            replies: dict[str, str] = {}
            prompt = cached = 0
            for name in order:
                seconds, replies[name], usage = ttft(clients[name], messages, args.max_tokens)
                times.setdefault((name, index), []).append(seconds)
                if name == "meshd":
                    details = usage.prompt_tokens_details if usage else None
                    cached = (details.cached_tokens or 0) if details else 0
                else:
                    prompt = usage.prompt_tokens if usage else 0
            rows[index] = (prompt, cached)
            print(f"round {round_ + 1} turn {index + 1}: prompt {prompt}, meshd cached "
                  f"{cached}, meshd {times[('meshd', index)][-1]:.2f} s, llama-server "
                  f"{times[('llama', index)][-1]:.2f} s", flush=True)  # fmt: skip
            messages.append({"role": "assistant", "content": replies["meshd"]})
    print("\nturn prompt cached  meshd_s  llama_s  ratio")
    for index in range(args.turns):
        m = statistics.median(times[("meshd", index)])
        ll = statistics.median(times[("llama", index)])
        prompt, cached = rows[index]
        print(f"{index + 1:4d} {prompt:6d} {cached:6d} {m:8.2f} {ll:8.2f} {m / ll:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="llama-server's; meshd's per daemon "
                   "is this / stages")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--system-chars", type=int, default=2600)
    p.add_argument("--repack", action="store_true", help="let llama.cpp repack weights")
    args = p.parse_args()
    model = os.path.expanduser(args.model)
    print(f"load average before: {os.getloadavg()}", flush=True)
    llama = start_llama(model, args.threads, args.repack)
    with tempfile.TemporaryDirectory(prefix="meshd-vs-llama-") as tmp:
        daemons = start_meshd(
            pathlib.Path(tmp), model, args.stages, max(1, args.threads // args.stages)
        )
        try:
            chat(args, daemons[0].api_url)
        finally:
            kill_all(daemons)
            llama.kill()
            llama.wait()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
