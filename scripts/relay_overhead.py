"""What relaying a request to a model's holder costs (a measurement, not a test).

The mesh of `test_several_models` (n2: the built-in model, n3: both, n4: the second model);
the same greedy completion of the second model is asked of n2 (which relays it to a holder),
n3 and n4 directly, in alternating rounds; medians. Run in a network namespace of its own:

    unshare -rn sh -c 'ip link set lo up && .venv/bin/python scripts/relay_overhead.py 20 24'

(arguments: rounds, max_tokens).
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the test helpers

from meshd.cli.supervisor import kill_all, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from tests.node.daemons import Daemon
from tests.node.test_several_models import (
    BUILTIN,
    SECOND,
    _completion,
    _serving,
    second_checkpoint,
)


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
        d: dict[str, Daemon] = {}
        try:
            for i, name in ((2, "n2"), (3, "n3"), (4, "n4")):
                secret = "relay-overhead-secret-0123456789"
                d[name] = Daemon(tmp, i, secret=secret, budget=budget, extra=flags[name])
            started(d.values())
            holders = {
                BUILTIN: {d["n2"].key(), d["n3"].key()},
                SECOND: {d["n3"].key(), d["n4"].key()},
            }
            wait_until(lambda: _serving(list(d.values()), holders), 60, "both models planned")
            prompt = Tokenizer.open(builtin_model_dir()).encode("def fibonacci(n):\n")
            times: dict[str, list[float]] = {"n2 (relays)": [], "n3": [], "n4": []}
            for _ in range(rounds):
                for label, ts in times.items():
                    t0 = time.perf_counter()
                    reply = _completion(d[label.split()[0]], SECOND, prompt, max_tokens)
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
