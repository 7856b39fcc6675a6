"""`meshd bench decode`: meshd's decode loop vs transformers `generate()`, side by side.

Single process, single node, greedy, batch 1, one checkpoint. Runs alternate (meshd,
transformers, meshd, ...) so that noise from a shared machine hits both alike, and the median of
each is reported with their ratio. transformers is a bench/dev extra, imported only here.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import math
import pathlib
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from meshd.bench.harness import alternate, print_report
from meshd.bench.reference import transformers_model
from meshd.bench.single_node import generate
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint, expected_shapes
from meshd.model.errors import TokenizerError
from meshd.model.files import is_gguf, open_checkpoint, open_tokenizer
from meshd.model.gguf_matrix import GgufMatrix
from meshd.model.quant import NAMES, check_quantization, in_features, matmul
from meshd.model.stage import StageModel
from meshd.model.threads import configure_threads

# Shapes for `--random-config`. "small" matches the built-in model's shape; "large" is a
# few hundred million parameters, to show where the loop stands once matmuls dominate.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                  tie_word_embeddings=True),
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip
DEFAULT_PROMPT = "def fibonacci(n):\n    "


@dataclass(frozen=True)
class BenchSettings:
    """What one bench run measures."""

    tokens: int
    rounds: int
    prompt: str
    dtype: torch.dtype
    device: str
    quantization: str = "none"
    kv_dtype: torch.dtype | None = None
    transformers: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench decode`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", type=pathlib.Path, help="checkpoint directory or .gguf file (default: built-in)"
    )
    source.add_argument(
        "--random-config",
        choices=sorted(RANDOM_CONFIGS),
        help="write a random checkpoint of this size to a temp dir and bench it",
    )
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per run (default 64)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each (default 5)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--quantization",
        choices=("auto", *NAMES),
        default="auto",
        help="meshd's weight format (default auto: the checkpoint's own, as the daemon does: "
        "none for safetensors, gguf for a quantized GGUF file; int8/int4 are q8_0/q4_k; "
        "transformers stays in "
        "--dtype)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="meshd's KV cache element type (default: --dtype)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="cores for compute (0 = all; a model too small to share runs on one, as in the "
        "daemon; default: torch's own setting)",
    )
    parser.add_argument(
        "--no-transformers",
        action="store_true",
        help="time meshd alone (no transformers runs; ratio fields are null)",
    )
    parser.add_argument(
        "--speculative-draft-model",
        type=pathlib.Path,
        default=None,
        help="also time this draft model (dir or .gguf) alone, meshd only: `draft` in the "
        "report, and draft_cost_ratio = its time per token ÷ the model's",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="time the prefill of an N-token prompt instead of decode (meshd alone; compare "
        "with llama-bench -p N -n 0)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds (< 30 s)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of meshd's loop")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Entry point: resolve the checkpoint, run the interleaved comparison, report."""
    if args.prefill is not None and args.speculative_draft_model is not None:
        raise SystemExit("--prefill times the model alone: leave out --speculative-draft-model")
    settings = BenchSettings(
        tokens=args.tokens or (32 if args.quick else 64),
        rounds=args.rounds or (3 if args.quick else 5),
        prompt=args.prompt,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        quantization=args.quantization,
        kv_dtype=getattr(torch, args.kv_dtype) if args.kv_dtype else None,
        transformers=not args.no_transformers,
    )
    with _checkpoint_dir(args) as (directory, label):
        checkpoint = open_checkpoint(directory)
        if settings.quantization == "auto":
            settings = replace(settings, quantization=checkpoint.default_quantization)
        settings = replace(settings, quantization=check_quantization(settings.quantization))
        if args.threads is not None:
            configure_threads(
                args.threads, checkpoint.config, settings.dtype, settings.quantization
            )
        if args.prefill is not None:
            report = bench_prefill(directory, settings, args.prefill)
        else:
            report = bench(directory, settings, profile=args.profile)
    if args.speculative_draft_model is not None:
        draft_dir = args.speculative_draft_model
        own = open_checkpoint(draft_dir).default_quantization
        quantization = own if args.quantization == "auto" else settings.quantization
        mine = replace(settings, transformers=False, quantization=quantization)
        report["draft"] = bench(draft_dir, mine)
        report["draft"]["model"] = str(draft_dir)
        report["draft_cost_ratio"] = round(
            report["meshd_tok_s"] / report["draft"]["meshd_tok_s"], 3
        )
    report["model"] = label
    report["threads_requested"] = args.threads
    print_report(report, args.json, _print_report)
    return 0


@contextlib.contextmanager
def _checkpoint_dir(args: argparse.Namespace) -> Iterator[tuple[pathlib.Path, str]]:
    if args.model is not None:
        yield args.model, str(args.model)
        return
    builtin = builtin_model_dir()
    name = args.random_config
    if name is None and (builtin / "config.json").is_file():
        yield builtin, "built-in"
        return
    name = name or "small"
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as tmp:
        write_random_checkpoint(pathlib.Path(tmp), name)
        yield pathlib.Path(tmp), f"random-{name}"


def write_random_checkpoint(directory: pathlib.Path, name: str, seed: int = 0) -> None:
    """A randomly initialised Llama checkpoint of shape `RANDOM_CONFIGS[name]`."""
    transformers = _transformers()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(max_position_embeddings=4096, **RANDOM_CONFIGS[name])
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)


def _whole_model(directory: pathlib.Path, settings: BenchSettings) -> tuple[Checkpoint, StageModel]:
    """The checkpoint and all its layers in one stage, as `settings` asks."""
    checkpoint = open_checkpoint(directory)
    stage = StageModel.load(
        checkpoint,
        0,
        checkpoint.config.num_layers,
        device=settings.device,
        dtype=settings.dtype,
        quantization=settings.quantization,
        kv_dtype=settings.kv_dtype,
    )
    return checkpoint, stage


def bench(
    directory: pathlib.Path, settings: BenchSettings, *, profile: bool = False
) -> dict[str, Any]:
    """Interleaved meshd / transformers greedy runs; medians, ratio and agreement."""
    checkpoint, stage = _whole_model(directory, settings)
    prompt = prompt_ids(directory, settings.prompt, checkpoint.config.vocab_size)

    def ours() -> list[int]:
        return generate([stage], prompt, settings.tokens).tokens

    theirs: Callable[[], list[int]] | None = None
    params = sum(  # the main model's parameters (a tied head counted once, MTP not at all)
        math.prod(shape)
        for name, shape in expected_shapes(checkpoint.config).items()
        if not name.startswith("mtp.")
    )
    if settings.transformers:
        _transformers()  # imported and quietened before the reference model loads
        hf = transformers_model(directory, settings.dtype).to(settings.device)
        hf.eval()
        # Neither side may stop early: both decode exactly `tokens` tokens.
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        params = sum(p.numel() for p in hf.parameters())
        input_ids = torch.tensor([prompt], device=settings.device)

        def theirs() -> list[int]:
            with torch.inference_mode():
                out = hf.generate(input_ids, max_new_tokens=settings.tokens, do_sample=False)
            return [int(t) for t in out[0, len(prompt) :]]

        theirs()
    ours()  # warm-up: allocator, kernels, lazy init
    runs = _interleave(ours, theirs, settings.rounds)
    ours_tok_s = statistics.median(runs.ours_tok_s)
    ours_cpu = statistics.median(runs.ours_cpu_ms)
    theirs_tok_s = statistics.median(runs.theirs_tok_s) if runs.theirs_tok_s else None
    theirs_cpu = statistics.median(runs.theirs_cpu_ms) if runs.theirs_cpu_ms else None
    report: dict[str, Any] = {
        "meshd_tok_s": round(ours_tok_s, 2),
        "transformers_tok_s": _round(theirs_tok_s, 2),
        "ratio": _round(theirs_tok_s and ours_tok_s / theirs_tok_s, 3),
        # CPU time per token excludes time the OS gave to other processes (a shared machine).
        "meshd_cpu_ms_per_tok": round(ours_cpu, 3),
        "transformers_cpu_ms_per_tok": _round(theirs_cpu, 3),
        "cpu_ratio": _round(theirs_cpu and theirs_cpu / ours_cpu, 3),
        "same_tokens": runs.same_tokens if theirs is not None else None,
        "tokens": settings.tokens,
        "rounds": settings.rounds,
        "prompt_tokens": len(prompt),
        "params": params,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "quantization": settings.quantization,
        "kv_dtype": str(stage.kv_dtype).removeprefix("torch."),
        # Bytes the stage holds: weights (embedding and head included, padding included) and
        # KV cache per position.
        "weight_bytes": stage.weight_bytes,
        "kv_bytes_per_token": stage.kv_bytes_per_token,
        # Which kernels multiply the stage's matrices (docs/model-runtime.md).
        "kernels": sorted(
            {m.kernel if isinstance(m, GgufMatrix) else "torch mm" for m in stage.weight_matrices()}
        ),
        # "meshd layers" where steps run every layer in one kernel call, else None.
        "layer_kernel": stage.layer_kernel,
        "device": settings.device,
        "threads": torch.get_num_threads(),
        # What the stage's thread governor runs decode steps on now (None: not governed, one
        # thread given).
        "governed_threads": stage.governor.current(1) if stage.governor else None,
        "meshd_runs_tok_s": [round(r, 2) for r in runs.ours_tok_s],
        "transformers_runs_tok_s": [round(r, 2) for r in runs.theirs_tok_s],
    }
    floor_ms = _matmul_floor_cpu_ms(stage)
    report["matmul_floor_cpu_ms_per_tok"] = round(floor_ms, 3)
    # Even a loop with no overhead at all could not beat transformers by more than this.
    report["max_cpu_ratio"] = _round(theirs_cpu and theirs_cpu / floor_ms, 3)
    if profile:
        report["profile"] = _profile(ours)
    return report


def bench_prefill(directory: pathlib.Path, settings: BenchSettings, tokens: int) -> dict[str, Any]:
    """meshd's prefill of a `tokens`-long prompt (fixed pseudo-random ids, as llama-bench's
    prompt test uses), timed `settings.rounds` times after a warm-up: tok/s, median and runs."""
    if tokens < 1:
        raise ValueError("--prefill needs at least one token")
    checkpoint, stage = _whole_model(directory, settings)
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, checkpoint.config.vocab_size, (tokens,), generator=gen).tolist()
    generate([stage], prompt, 1)  # warm-up: allocator, kernels, lazy init
    rates = [tokens / generate([stage], prompt, 1).prefill_s for _ in range(settings.rounds)]
    return {
        "prefill_tokens": tokens,
        "meshd_prefill_tok_s": round(statistics.median(rates), 2),
        "meshd_prefill_runs_tok_s": [round(r, 2) for r in rates],
        "rounds": settings.rounds,
        "quantization": settings.quantization,
        "kernels": sorted(
            {m.kernel if isinstance(m, GgufMatrix) else "torch mm" for m in stage.weight_matrices()}
        ),
        "device": settings.device,
        "threads": torch.get_num_threads(),
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class _Runs:
    ours_tok_s: list[float]
    theirs_tok_s: list[float]
    ours_cpu_ms: list[float]
    theirs_cpu_ms: list[float]
    same_tokens: bool = True


def _interleave(
    ours: Callable[[], list[int]], theirs: Callable[[], list[int]] | None, rounds: int
) -> _Runs:
    """Run A B A B ... (A alone without B); wall-clock tok/s and CPU ms per token for each."""
    sides = {"ours": _timed(ours)}
    if theirs is not None:
        sides["theirs"] = _timed(theirs)
    results = alternate(sides, rounds)
    runs = _Runs([], [], [], [])
    for side, rates, cpu in (
        ("ours", runs.ours_tok_s, runs.ours_cpu_ms),
        ("theirs", runs.theirs_tok_s, runs.theirs_cpu_ms),
    ):
        for tokens, wall_s, cpu_s in results.get(side, []):
            cpu.append(cpu_s * 1e3 / len(tokens))
            rates.append(len(tokens) / wall_s)
    other = results.get("theirs", results["ours"])
    runs.same_tokens = all(a[0] == b[0] for a, b in zip(results["ours"], other, strict=True))
    return runs


def _timed(fn: Callable[[], list[int]]) -> Callable[[], tuple[list[int], float, float]]:
    """`fn` returning its tokens, wall seconds and CPU seconds."""

    def run() -> tuple[list[int], float, float]:
        wall, cpu_started = time.perf_counter(), time.process_time()
        tokens = fn()
        return tokens, time.perf_counter() - wall, time.process_time() - cpu_started

    return run


def _matmul_floor_cpu_ms(stage: StageModel, steps: int = 20) -> float:
    """CPU ms per token of one decode step's matmuls alone (same weights, same order)."""
    matrices = stage.weight_matrices()  # [in, out], as the forward pass multiplies them
    inputs = {
        in_features(m): torch.randn(1, in_features(m), dtype=stage.dtype, device=stage.device)
        for m in matrices
    }
    with torch.inference_mode():
        for m in matrices:
            matmul(inputs[in_features(m)], m)
        started = time.process_time()
        for _ in range(steps):
            for m in matrices:
                matmul(inputs[in_features(m)], m)
    return (time.process_time() - started) * 1e3 / steps


def _transformers() -> Any:
    """transformers, imported only when benchmarking (it is a bench/dev extra), kept quiet."""
    import transformers

    module: Any = transformers
    module.logging.set_verbosity_error()
    module.utils.logging.disable_progress_bar()
    return module


def prompt_ids(directory: pathlib.Path, text: str, vocab_size: int) -> list[int]:
    """`text` by the model's tokenizer, or a fixed pseudo-random prompt where it has none."""
    if is_gguf(directory) or (directory / "tokenizer.json").is_file():
        try:
            ids = open_tokenizer(directory).encode(text)
        except TokenizerError:  # a GGUF file without tokenizer metadata
            ids = []
        if ids:
            return ids
    # Random checkpoints have no tokenizer: a fixed pseudo-random prompt of 12 ids.
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (12,), generator=gen).tolist()


def _profile(fn: Callable[[], list[int]]) -> str:
    """torch.profiler's top ops by self CPU time over one meshd run, then cProfile's top."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
    return ops + "\n" + out.getvalue()


def _print_report(report: dict[str, Any]) -> None:
    if "prefill_tokens" in report:
        print(
            f"model: {report['model']}: prefill of {report['prefill_tokens']} tokens, "
            f"{report['threads']} threads, weights {report['quantization']} "
            f"({', '.join(report['kernels'])})"
        )
        print(
            f"  meshd {report['meshd_prefill_tok_s']:.1f} tok/s "
            f"(runs: {report['meshd_prefill_runs_tok_s']})"
        )
        return
    print(f"model: {report['model']} ({report['params'] / 1e6:.1f} M params)")
    if str(report["model"]).startswith("random-"):
        print("  (random weights written to a temp dir; speed only, the text is meaningless)")
    print(
        f"greedy, batch 1, {report['tokens']} new tokens after a {report['prompt_tokens']}-token "
        f"prompt, {report['rounds']} interleaved rounds, {report['dtype']} on {report['device']} "
        f"({report['threads']} threads); meshd weights {report['quantization']}, KV "
        f"{report['kv_dtype']}"
    )
    print(
        f"  meshd holds {report['weight_bytes'] / 1e6:.1f} MB of weights, "
        f"{report['kv_bytes_per_token']} KV bytes per position; kernels: "
        f"{', '.join(report['kernels'])}"
    )
    print(
        f"  meshd         {report['meshd_tok_s']:>9.1f} tok/s  (runs: {report['meshd_runs_tok_s']})"
    )
    if report["transformers_tok_s"] is not None:
        print(
            f"  transformers  {report['transformers_tok_s']:>9.1f} tok/s  "
            f"(runs: {report['transformers_runs_tok_s']})"
        )
        print(
            f"  ratio         {report['ratio']:>9.2f}x   same greedy tokens: "
            f"{report['same_tokens']}"
        )
        print(
            f"  CPU time per token: meshd {report['meshd_cpu_ms_per_tok']:.2f} ms, transformers "
            f"{report['transformers_cpu_ms_per_tok']:.2f} ms (ratio {report['cpu_ratio']:.2f}x)"
        )
    print(f"  matmuls alone: {report['matmul_floor_cpu_ms_per_tok']:.2f} ms per token")
    if report["max_cpu_ratio"] is not None:
        print(f"  so no loop could beat transformers by more than {report['max_cpu_ratio']:.2f}x")
    if "profile" in report:
        print(report["profile"])
