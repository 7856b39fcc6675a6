"""What relaying a request to a model's holder costs (a measurement, not a test).

The mesh of tests/node/test_several_models.py (n2: the built-in model, n3: both, n4: the second model);
the same greedy completion of the second model is asked of n2 (which relays it to a holder),
n3 and n4 directly, in alternating rounds; medians. Run in a network namespace of its own:

    unshare -rn sh -c 'ip link set lo up && .venv/bin/python scripts/relay_overhead.py 20 24'

(arguments: rounds, max_tokens).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx

from meshd.bench.decode import write_random_checkpoint
from meshd.cli.supervisor import (
    LoopbackDaemon,
    kill_all,
    stage_budget,
    started,
    wait_until,
    write_secret_file,
)
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer

BUILTIN = "meshd-builtin"
SECOND = "second-model"


def second_checkpoint(directory: pathlib.Path) -> pathlib.Path:
    """A random checkpoint of the built-in model's shape, with the built-in tokenizer."""
    write_random_checkpoint(directory, "small", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_model_dir() / name, directory / name)
    return directory


def serving(daemons: list[LoopbackDaemon], holders: dict[str, set[str]]) -> bool:
    """Every daemon lists every model, and each model's holders have loaded its plan."""
    for d in daemons:
        s = d.try_status()
        if s is None:
            return False
        for name, keys in holders.items():
            entry = next((m for m in s["models"] if m["name"] == name), None)
            if entry is None or not entry["plan"] or set(entry["holders"]) != keys:
                return False
            if entry["held"]:
                mine = [st["layers"] for st in entry["plan"] if st["key"] == s["key"]]
                if entry["stage_layers"] != (mine[0] if mine else None):
                    return False
    return True


def completion(d: LoopbackDaemon, model: str, prompt: list[int], max_tokens: int) -> Any:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "meshd": {"ignore_eos": True},
    }
    return httpx.post(f"{d.api_url}/completions", json=body, timeout=120)


def main(rounds: int, max_tokens: int) -> None:
    with tempfile.TemporaryDirectory(prefix="meshd-relay-") as work:
        tmp = pathlib.Path(work)
        second = second_checkpoint(tmp / SECOND)
        budget = 4 * stage_budget(str(second), 1)
        flags: dict[str, tuple[str, ...]] = {
            "n2": (),
            "n3": ("--model", "", "--model", str(second)),
            "n4": ("--model", str(second)),
        }
        d: dict[str, LoopbackDaemon] = {}
        secret = write_secret_file(tmp / "mesh.secret", "relay-overhead-secret-0123456789")
        lane = ("--lane-dead-after-s", "1.2")
        try:
            for i, name in ((2, "n2"), (3, "n3"), (4, "n4")):
                extra = (*lane, *flags[name])
                host = f"127.0.0.{i}"
                d[name] = LoopbackDaemon(tmp, name, host, secret, budget, None, extra=extra)
            started(d.values())
            holders = {
                BUILTIN: {d["n2"].key(), d["n3"].key()},
                SECOND: {d["n3"].key(), d["n4"].key()},
            }
            wait_until(lambda: serving(list(d.values()), holders), 60, "both models planned")
            prompt = Tokenizer.open(builtin_model_dir()).encode("def fibonacci(n):\n")
            times: dict[str, list[float]] = {"n2 (relays)": [], "n3": [], "n4": []}
            for _ in range(rounds):
                for label, ts in times.items():
                    t0 = time.perf_counter()
                    reply = completion(d[label.split()[0]], SECOND, prompt, max_tokens)
                    ts.append(time.perf_counter() - t0)
                    assert reply.status_code == 200, reply.text
            print(f"second model, {max_tokens} tokens, {rounds} rounds:")
            for label, ts in times.items():
                print(f"  {label}: median {statistics.median(ts) * 1000:.1f} ms")
        finally:
            kill_all(d.values())


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else 24
    )
