"""What every `meshd bench NAME` shares: the model and quantization options, the `--json`
report or its table, contestants run in alternating rounds, nearest-rank percentiles and
medians.

Benches run their contestants in alternating rounds in one process (this machine is shared
and noisy: drift hits every contestant alike) and report medians and ratios to a baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from meshd.speculative.draft import DraftModel

T = TypeVar("T")

MODEL_HELP = "checkpoint dir or .gguf (default: built-in)"
# What a bench quantizes a checkpoint to at load (`meshd.model.quant.NAMES` but gguf; int8 and
# int4 are aliases of q8_0 and q4_k).
QUANTIZATIONS = ("none", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "int8", "int4")


def add_model_option(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """`--model`: the checkpoint to bench (the built-in model when not given)."""
    parser.add_argument("--model", default=None, help=help)


def add_quantization_option(parser: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """`--quantization`: the stage weight format (none, or a ggml block format or its alias);
    with `auto`, also "auto" (the default): the checkpoint's own, as the daemon runs it."""
    parser.add_argument(
        "--quantization",
        choices=("auto", *QUANTIZATIONS) if auto else QUANTIZATIONS,
        default="auto" if auto else "none",
        help="stage weight format (docs/model-runtime.md)"
        + ("; auto: the checkpoint's own (a GGUF file's tensors as stored)" if auto else ""),
    )


def resolve_quantization(quantization: str, directory: str) -> str:
    """The scheme `quantization` names (an alias resolved), or for "auto" the checkpoint's own
    (`Checkpoint.default_quantization`)."""
    from meshd.model.quant import check_quantization

    if quantization != "auto":
        return check_quantization(quantization)
    from meshd.model.files import open_checkpoint

    return open_checkpoint(directory).default_quantization


def load_draft(path: str, quantization: str) -> DraftModel:
    """(blocking) The draft model at `path` as a coordinator loads it: at `quantization`, keeping
    finished requests' KV within the daemon's default `stage.prefix_cache_bytes`. Load it before
    any lane opens: a load blocks the event loop, and one that outlasts the lanes' dead_after_s
    would lose the route."""
    from meshd.speculative.draft import DraftModel
    from meshd.stage.host_config import StageHostConfig

    prefix_cache_bytes = StageHostConfig().prefix_cache_bytes
    return DraftModel.load(path, quantization=quantization, prefix_cache_bytes=prefix_cache_bytes)


def model_dir(args: argparse.Namespace) -> str:
    """`--model`, or the built-in model's directory."""
    if args.model:
        return str(args.model)
    from meshd.model.builtin import builtin_model_dir

    return str(builtin_model_dir())


def print_report(
    report: dict[str, Any],
    as_json: bool,
    table: Callable[[dict[str, Any]], None],
    default: Callable[[Any], Any] | None = None,
) -> None:
    """The report as one JSON line (`--json`, what `meshd bench plot` reads), else its table."""
    if as_json:
        print(json.dumps(report, default=default))
    else:
        table(report)


def nearest_rank(ranked: Sequence[float], p: float) -> float | None:
    """The p-th percentile of sorted values by nearest rank (None when there are none)."""
    if not ranked:
        return None
    return ranked[max(0, math.ceil(p / 100 * len(ranked)) - 1)]


def median(values: Iterable[float]) -> float:
    """The median as a float (statistics.median keeps ints)."""
    return float(statistics.median(values))


def alternate(
    contestants: Mapping[str, Callable[[], T]], rounds: int, warmup: int = 0
) -> dict[str, list[T]]:
    """Run every contestant once per round, in order (A B A B ...), so machine noise hits
    them alike; the first `warmup` rounds are run and dropped. Each one's results, in order."""
    results: dict[str, list[T]] = {name: [] for name in contestants}
    for done in range(warmup + rounds):
        for name, run in contestants.items():
            result = run()
            if done >= warmup:
                results[name].append(result)
    return results


async def alternate_async(
    contestants: Mapping[str, Callable[[], Awaitable[T]]], rounds: int, warmup: int = 0
) -> dict[str, list[T]]:
    """`alternate` for contestants that are awaited."""
    results: dict[str, list[T]] = {name: [] for name in contestants}
    for done in range(warmup + rounds):
        for name, run in contestants.items():
            result = await run()
            if done >= warmup:
                results[name].append(result)
    return results
