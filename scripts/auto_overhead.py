"""What `auto`'s own bookkeeping costs per request, timed method by method.

    python scripts/auto_overhead.py                  # 1 stage, the bench's heapq prose prompt
    python scripts/auto_overhead.py --stages 2 --prompt base64.b64encode

Opens a local pipeline of the built-in model (RTT 0), teaches the model's `AcceptanceBook`
with one `auto` request per bench prompt (as `meshd bench spec` does within a cell), then runs
the chosen prompt once with `auto` and once with `disabled`, and prints the time spent in
`AutoProposer`'s methods (the `Proposer` interface: `observe` holds shadow drafting, scoring,
deciding and the n-gram indexes) next to the two decode times. `--profile` runs the `auto`
request a second time under cProfile and lists the functions of `meshd.speculative` by their
own time (the profiler slows them, so only the shares mean something).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import os
import pathlib
import pstats
import time
from collections.abc import Callable
from typing import Any

import trio

from meshd.bench.spec import generate
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative import auto
from meshd.speculative.config import SpecConfig

# The proposer interface the coordinator calls (`meshd.speculative.proposer.Proposer`).
METHODS = ("observe", "propose", "propose_after", "set_link")
spent: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started
            calls[name] += 1

    return wrapper


def _print_profile(profile: cProfile.Profile, top: int = 15) -> None:
    """The functions of meshd.speculative by their own time in the profiled request."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = [
        (own, calls, f"{pathlib.Path(file).name}:{line} {name}")
        for (file, line, name), (_cc, calls, own, _cum, _callers) in stats.items()
        if f"meshd{os.sep}speculative{os.sep}" in file
    ]
    total = sum(own for own, _, _ in rows)
    print(f"  under cProfile, meshd.speculative's own time {total * 1e3:.1f} ms; the top {top}:")
    for own, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"    {where:44} {calls:6} calls {own / total:6.1%}")


async def _run(stages: int, prompt: str, tokens: int, profile: bool) -> None:
    model = str(builtin_model_dir())
    tok = open_tokenizer(model)
    loads = workloads(2)
    (load,) = [w for w in loads if w.name == prompt]
    eos = frozenset(tok.eos_ids)
    async with open_local_pipeline(model, stages, rtt_s=0.0, wire_dtype="f16", eos_ids=eos) as pipe:
        spec = SpecConfig()
        await generate(pipe, tok.encode(loads[0].prompt), 8, "disabled", 2, spec)
        for other in loads:
            await generate(pipe, tok.encode(other.prompt), tokens, "auto", 2, spec)
        ids = tok.encode(load.prompt)
        spent.clear()
        calls.clear()
        with_auto = await generate(pipe, ids, tokens, "auto", 2, spec)
        plain = await generate(pipe, ids, tokens, "disabled", 2, spec)
        timed, counted = dict(spent), dict(calls)
        profiler = cProfile.Profile()
        if profile:
            profiler.enable()
            await generate(pipe, ids, tokens, "auto", 2, spec)
            profiler.disable()
    print(
        f"{stages} stage(s), {load.kind} {load.name}, {tokens} tokens: decode "
        f"auto {with_auto['decode_s'] * 1e3:.1f} ms (tokens per round trip "
        f"{with_auto['tpr']:.2f}, {with_auto['drafted']} drafted), disabled "
        f"{plain['decode_s'] * 1e3:.1f} ms"
    )
    for name in METHODS:
        if counted.get(name):
            print(f"  {name:14} {counted[name]:4} calls {timed[name] * 1e3:7.2f} ms")
    outer = sum(timed.get(n, 0.0) for n in METHODS)
    print(
        f"  auto's methods in all: "
        f"{outer * 1e3:.2f} ms, {outer / tokens * 1e6:.0f} us per token, "
        f"{outer / with_auto['decode_s']:.1%} of auto's decode time"
    )
    if profile:
        _print_profile(profiler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--prompt", default="heapq", help="a bench prompt's name")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--profile", action="store_true", help="and where in auto the time goes")
    args = parser.parse_args()
    for name in METHODS:
        setattr(auto.AutoProposer, name, _timed(name, getattr(auto.AutoProposer, name)))
    trio.run(_run, args.stages, args.prompt, args.tokens, args.profile)


if __name__ == "__main__":
    main()
