"""meshd next to llama.cpp on this machine: decode tok/s, 2-node splits, and GGUF files.

    nice -n 5 .venv/bin/python scripts/bench_llamacpp            # everything, a Markdown table
    .venv/bin/python scripts/bench_llamacpp --quick --models builtin --json

Steps (every output goes to the cache directory and is reused on the next run):
1. llama.cpp: `pip download` the llama-cpp-python sdist (it vendors llama.cpp's source), build
   llama-bench, llama-quantize and the RPC server with cmake (`-DGGML_NATIVE=ON -DGGML_RPC=ON`,
   under `nice -n 15`), and a small greedy-decoding tool (greedy.cpp) against its library.
2. Models: the built-in model (a copy without its mtp.* tensors for the converter) and meshd's
   246M random Llama (`write_random_checkpoint(dir, "large")`, the built-in tokenizer beside
   it); each converted with llama.cpp's own convert_hf_to_gguf.py to GGUF f32, then
   llama-quantize'd to q8_0 and q4_0.
3. Decode rows: `llama-bench -p 0 -n T -t N -r 1` against `meshd bench decode --tokens T
   --threads N --rounds 1` (fp32; `--quantization q8_0|q4_0` against q8_0|q4_0 where meshd has
   the flag: the same block formats, quantized by meshd at load), process by process in alternating rounds; medians and their ratio.
4. Two-node rows: llama.cpp's RPC server in a second process (`--rpc`, half the layers each)
   against `meshd bench pipeline --stages 2`, plain greedy, at each RTT (llama.cpp through a
   loopback TCP proxy delaying each direction by RTT/2; meshd through its own `--rtt-ms`).
5. GGUF rows: meshd loading the converter's files (`--model file.gguf`) where it can, and
   greedy agreement: meshd's tokens against llama.cpp's on the f32 file, same prompt ids.
6. Quality rows (`--parts quality`): real GGUF files (`--quality-models`: paths, or names of
   scripts/fetch_models, which fetches them), the first `--quality-tokens` ids of `--text`
   (meshd's tokenizer for the file, `meshd bench perplexity --text`), then the same ids through
   `meshd bench perplexity --token-ids` at each `--quality-quantizations` (default: the daemon's
   own choice, and `none`) and through score.cpp (llama.cpp, all positions in one batch):
   perplexity both sides, their ratio, and top-1 agreement (share of positions whose argmax
   is the same id).
7. ggml rows (`--parts ggml`): ggml_mm.c, one ggml_mul_mat per call at decode shapes, per-call
   microseconds and GB/s (docs/model-runtime.md, "ggml as the kernel library: measured").

`--llamacpp-build avx2` uses a second llama.cpp build without AVX-512, AVX-VNNI or AMX
(`-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF ...`, its own
build directory) for every part: the comparison an AVX2-only CPU would see.

Rows where meshd lacks a feature say `"meshd_tok_s": null, "note": "unsupported"`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import llamacpp
from delay_proxy import delay_proxy
from llamacpp import LlamaCpp, log

REPO = pathlib.Path(__file__).resolve().parents[2]
MESHD_SIDE = pathlib.Path(__file__).resolve().parent / "meshd_side.py"
DEFAULT_VERSION = "0.3.36"
PRECISIONS = ("f32", "q8_0", "q4_0")
# meshd's `--quantization` value measured against each llama.cpp precision.
MESHD_QUANT = {"f32": "none", "q8_0": "q8_0", "q4_0": "q4_0"}
MODELS = ("builtin", "large")
FETCH_MODELS = REPO / "scripts" / "fetch_models"
DEFAULT_TEXT = REPO / "docs" / "bench" / "prose.txt"


@dataclass
class Model:
    """One checkpoint on both sides: meshd's directory and the converter's GGUF files."""

    name: str
    meshd_dir: pathlib.Path  # what meshd loads (the built-in: its own directory)
    hf_dir: pathlib.Path  # what the converter read
    layers: int
    gguf: dict[str, pathlib.Path] = field(default_factory=dict)


@dataclass
class Env:
    lc: LlamaCpp
    python: str
    meshd: str
    work: pathlib.Path
    tokens: int
    rounds: int


# -- preparation --------------------------------------------------------------------------
def _side(python: str, *args: str) -> Any:
    """Run meshd_side.py with meshd's Python; its JSON answer."""
    out = subprocess.run([python, str(MESHD_SIDE), *args], capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"meshd_side {args[0]}: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_model(name: str, env: Env) -> Model:
    """The model's HF directory for the converter and its three GGUF files (cached)."""
    root = env.work / name
    hf = root / "hf"
    stamp = root / "source.json"
    source: dict[str, object]
    if name == "builtin":
        builtin = pathlib.Path(
            subprocess.run(
                [
                    env.python,
                    "-c",
                    "from meshd.model.builtin import builtin_model_dir as d; print(d())",
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        source = {"model": name, "sha256": _sha256(builtin / "model.safetensors")}
        meshd_dir = builtin
    elif name == "large":
        source = {"model": name, "write_random_checkpoint": "large", "seed": 0}
        meshd_dir = hf
    else:
        raise SystemExit(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    if not stamp.is_file() or json.loads(stamp.read_text()) != source:
        log(f"{name}: writing the checkpoint for the converter into {hf}")
        shutil.rmtree(root, ignore_errors=True)
        command = "builtin-for-converter" if name == "builtin" else "write-large"
        log(f"{name}: {_side(env.python, command, str(hf))}")
        stamp.write_text(json.dumps(source))
    layers = int(json.loads((hf / "config.json").read_text())["num_hidden_layers"])
    model = Model(name, meshd_dir, hf, layers)
    f32 = root / "f32.gguf"
    if not f32.is_file():
        log(f"{name}: convert_hf_to_gguf.py --outtype f32")
        llamacpp.convert(env.lc, env.python, hf, f32.with_suffix(".tmp"), root / "convert.log")
        f32.with_suffix(".tmp").rename(f32)
    model.gguf["f32"] = f32
    for kind in PRECISIONS[1:]:
        path = root / f"{kind}.gguf"
        if not path.is_file():
            log(f"{name}: llama-quantize {kind}")
            llamacpp.quantize(env.lc, f32, path.with_suffix(".tmp"), kind, root / "quantize.log")
            path.with_suffix(".tmp").rename(path)
        model.gguf[kind] = path
    return model


# -- meshd --------------------------------------------------------------------------------
def meshd_help(env: Env, bench: str) -> str:
    out = subprocess.run([env.meshd, "bench", bench, "--help"], capture_output=True, text=True)
    return out.stdout


def meshd_quant_choices(help_text: str) -> set[str]:
    """The `--quantization` values `meshd bench ... --help` offers (empty: no such flag)."""
    if "--quantization" not in help_text:
        return set()
    return {q for q in ("q8_0", "q4_0") if q in help_text} | {"none"}


def _meshd_json(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{' '.join(cmd)}: {last}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def meshd_decode(
    env: Env, model: str | None, threads: int, quant: str, tokens: int | None = None
) -> dict[str, Any]:
    """One `meshd bench decode --rounds 1 --no-transformers` process."""
    cmd = [
        env.meshd,
        "bench",
        "decode",
        "--tokens",
        str(tokens or env.tokens),
        "--threads",
        str(threads),
        "--rounds",
        "1",
        "--no-transformers",
        "--json",
    ]
    if model is not None:
        cmd += ["--model", model]
    if quant != "none":
        cmd += ["--quantization", quant]
    return _meshd_json(cmd)


def meshd_tok_s(report: dict[str, Any]) -> float:
    """meshd's tok/s from `bench decode --json` (`meshd_tok_s`; older names accepted)."""
    for key in ("meshd_tok_s", "tok_s", "ours_tok_s"):
        if key in report:
            return float(report[key])
    raise KeyError(f"no meshd tok/s in {sorted(report)}")


def _held_bytes(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if "bytes" in k}


# -- decode rows --------------------------------------------------------------------------
Task = tuple[str, str, Callable[[], float]]  # (side, label, run → tok/s)


def alternate(
    tasks: list[Task], rounds: int, failures: dict[tuple[str, str], str]
) -> dict[tuple[str, str], list[float]]:
    """Run every task once per round, the order rotated each round; tok/s per task.

    A run that fails is logged into `failures` (its last line) and the rest go on.
    """
    results: dict[tuple[str, str], list[float]] = {(s, label): [] for s, label, _ in tasks}
    for r in range(rounds):
        shift = r % len(tasks)
        for side, label, fn in tasks[shift:] + tasks[:shift]:
            try:
                results[(side, label)].append(round(fn(), 2))
            except (RuntimeError, KeyError, ValueError) as exc:
                failures[(side, label)] = str(exc).strip().splitlines()[-1][-300:]
                log(f"  round {r + 1}/{rounds} {side} {label}: FAILED {failures[(side, label)]}")
                continue
            log(f"  round {r + 1}/{rounds} {side} {label}: {results[(side, label)][-1]} tok/s")
    return results


def _note(failures: dict[tuple[str, str], str], *keys: tuple[str, str]) -> str | None:
    """The failure of any of these tasks, named by side."""
    for key in keys:
        if key in failures:
            return f"{key[0]} failed: {failures[key]}"
    return None


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def decode_rows(
    model: Model, threads: int, env: Env, quants: set[str], gguf_ok: bool
) -> list[dict[str, Any]]:
    """llama-bench on each GGUF vs meshd bench decode at the matching precision."""
    mdir = str(model.meshd_dir)
    tasks: list[Task] = []
    extra: dict[str, dict[str, Any]] = {}

    def meshd_run(label: str, path: str | None, quant: str) -> Callable[[], float]:
        def fn() -> float:
            report = meshd_decode(env, path, threads, quant)
            extra[label] = _held_bytes(report)
            return meshd_tok_s(report)

        return fn

    def llama_run(gguf: pathlib.Path) -> Callable[[], float]:
        return lambda: llamacpp.bench(env.lc, gguf, env.tokens, threads)[0]

    for prec, gguf in model.gguf.items():
        tasks.append(("llama.cpp", prec, llama_run(gguf)))
        quant = MESHD_QUANT[prec]
        if quant in quants or quant == "none":
            tasks.append(("meshd", prec, meshd_run(prec, mdir, quant)))
        if gguf_ok:
            tasks.append(("meshd-gguf", prec, meshd_run(f"gguf-{prec}", str(gguf), "none")))
    log(f"decode: {model.name}, {threads} thread(s), {env.rounds} round(s), {env.tokens} tokens")
    failures: dict[tuple[str, str], str] = {}
    runs = alternate(tasks, env.rounds, failures)
    fp32 = _median(runs.get(("meshd", "f32"), []))
    rows = []
    for prec, gguf in model.gguf.items():
        lc = _median(runs[("llama.cpp", prec)])
        for source in ("meshd", "meshd-gguf"):
            if source == "meshd-gguf" and not gguf_ok and prec != "f32":
                continue
            mine = runs.get((source, prec))
            row: dict[str, Any] = {
                "kind": "decode",
                "model": model.name,
                "precision": prec,
                "threads": threads,
                "meshd_source": "gguf" if source == "meshd-gguf" else "safetensors",
                # A GGUF file is served at its own default (`auto`: its blocks as stored).
                "meshd_quantization": "auto" if source == "meshd-gguf" else MESHD_QUANT[prec],
                "llamacpp_tok_s": lc,
                "meshd_tok_s": _median(mine) if mine else None,
                "ratio": _ratio(_median(mine) if mine else None, lc),
                "llamacpp_runs_tok_s": runs[("llama.cpp", prec)],
                "meshd_runs_tok_s": mine or [],
                "gguf_bytes": gguf.stat().st_size,
            }
            failed = _note(failures, ("llama.cpp", prec), (source, prec))
            if failed:
                row["note"] = failed
            elif (source, prec) not in runs:
                row["note"] = "unsupported"
            label = prec if source == "meshd" else f"gguf-{prec}"
            if extra.get(label):
                row["meshd_reported"] = extra[label]
            if source == "meshd" and prec != "f32":
                row["meshd_fp32_tok_s"] = fp32
                row["ratio_fp32"] = _ratio(fp32, lc)
            rows.append(row)
    return rows


# -- two-node rows ------------------------------------------------------------------------
def pipeline_rows(
    model: Model, env: Env, rtts: list[float], threads: int, quants: set[str]
) -> list[dict[str, Any]]:
    """llama.cpp RPC split (2 processes) vs `meshd bench pipeline --stages 2`, per RTT."""
    ngl = model.layers // 2 + 1  # the output layer counts as one: 16 layers → -ngl 9 → 8 + 8
    meshd_precs = [p for p in model.gguf if MESHD_QUANT[p] in quants or p == "f32"]
    server_log = env.work / "rpc-server.log"
    tasks: list[Task] = []
    meshd_cache: dict[tuple[str, float], list[float]] = {}

    def llama(prec: str, rtt: float) -> Callable[[], float]:
        def fn() -> float:
            with llamacpp.rpc_server(env.lc, threads, server_log) as port:
                if rtt == 0:
                    return llamacpp.bench(
                        env.lc, model.gguf[prec], env.tokens, threads, f"127.0.0.1:{port}", ngl
                    )[0]
                with delay_proxy(port, rtt / 2000) as proxied:
                    return llamacpp.bench(
                        env.lc, model.gguf[prec], env.tokens, threads, f"127.0.0.1:{proxied}", ngl
                    )[0]

        return fn

    def meshd(prec: str) -> Callable[[], float]:
        # One process measures every RTT (and its 1-stage calibration cell); the first RTT's
        # figure is this task's, the others are kept for their rows.
        def fn() -> float:
            cmd = [
                env.meshd,
                "bench",
                "pipeline",
                "--stages",
                "2",
                "--rtt-ms",
                *[f"{r:g}" for r in rtts],
                "--tokens",
                str(env.tokens),
                "--repeats",
                "1",
                "--strategies",
                "disabled",
                "--json",
            ]
            cmd += ["--model", str(model.meshd_dir)]
            if prec != "f32":
                cmd += ["--quantization", MESHD_QUANT[prec]]
            threads_env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            report = _meshd_json(cmd, threads_env)
            for row in report["rows"]:
                if row["table"] == "plain" and row["stages"] == 2 and row["rtt_ms"] in rtts:
                    tok_s = round(1000 / row["measured_ms_per_token"], 2)
                    meshd_cache.setdefault((prec, row["rtt_ms"]), []).append(tok_s)
            return meshd_cache[(prec, rtts[0])][-1]

        return fn

    for prec in model.gguf:
        for rtt in rtts:
            tasks.append(("llama.cpp", f"{prec} rtt {rtt:g}", llama(prec, rtt)))
        if prec in meshd_precs:
            tasks.append(("meshd", f"{prec} rtt {rtts[0]:g}+", meshd(prec)))
    log(f"pipeline: {model.name}, 2 stages, RTT {rtts} ms, {threads} thread(s) per stage")
    failures: dict[tuple[str, str], str] = {}
    runs = alternate(tasks, env.rounds, failures)
    rows = []
    for prec in model.gguf:
        for rtt in rtts:
            lc = _median(runs[("llama.cpp", f"{prec} rtt {rtt:g}")])
            mine = meshd_cache.get((prec, rtt), [])
            row: dict[str, Any] = {
                "kind": "pipeline",
                "model": model.name,
                "precision": prec,
                "threads": threads,
                "stages": 2,
                "rtt_ms": rtt,
                "split": f"llama.cpp -ngl {ngl} of {model.layers} layers; meshd 2 stages",
                "llamacpp_tok_s": lc,
                "meshd_tok_s": _median(mine),
                "ratio": _ratio(_median(mine), lc),
                "llamacpp_runs_tok_s": runs[("llama.cpp", f"{prec} rtt {rtt:g}")],
                "meshd_runs_tok_s": mine,
            }
            failed = _note(
                failures,
                ("llama.cpp", f"{prec} rtt {rtt:g}"),
                ("meshd", f"{prec} rtt {rtts[0]:g}+"),
            )
            if failed:
                row["note"] = failed
            elif prec not in meshd_precs:
                row["note"] = "unsupported"
            rows.append(row)
    return rows


# -- GGUF: loading and agreement ----------------------------------------------------------
def meshd_gguf_decode_ok(model: Model, env: Env, threads: int) -> tuple[bool, str]:
    """Whether `meshd bench decode --model file.gguf` runs (a 2-token probe on the f32 file)."""
    try:
        meshd_decode(env, str(model.gguf["f32"]), threads, "none", tokens=2)
    except RuntimeError as exc:
        return False, str(exc).rsplit(": ", 1)[-1]
    return True, ""


def _agreement(a: list[int], b: list[int]) -> dict[str, Any]:
    prefix = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    same = sum(x == y for x, y in zip(a, b, strict=False))
    return {
        "identical": a == b,
        "tokens_until_divergence": prefix,
        "share_identical": round(same / max(1, len(a)), 3),
    }


def agreement_rows(model: Model, env: Env, threads: int) -> list[dict[str, Any]]:
    """meshd's greedy tokens against llama.cpp's from the same prompt ids.

    Per GGUF file: meshd fp32 from its own checkpoint (for q8_0/q4_0 files this shows what
    llama.cpp's quantization alone changes), and meshd loading that same file where it can.
    """
    meshd_dir = str(model.meshd_dir)
    prompt = _side(env.python, "prompt", meshd_dir)
    ids = ",".join(map(str, prompt))
    n = str(env.tokens)
    ours = _side(env.python, "greedy", meshd_dir, n, str(threads), ids)
    rows = []
    for prec, gguf in model.gguf.items():
        base: dict[str, Any] = {
            "kind": "agreement",
            "model": model.name,
            "precision": prec,
            "tokens": env.tokens,
            "prompt_ids": prompt,
        }
        try:
            theirs = llamacpp.greedy_tokens(env.lc, gguf, prompt, env.tokens, threads)
        except RuntimeError as exc:
            last = str(exc).strip().splitlines()[-1]
            rows.append(
                {
                    **base,
                    "meshd_source": "-",
                    "identical": None,
                    "note": f"llama.cpp failed: {last}",
                }
            )
            continue
        rows.append(
            {
                **base,
                "meshd_source": "safetensors fp32",
                **_agreement(ours, theirs),
                "meshd_tokens": ours,
                "llamacpp_tokens": theirs,
            }
        )
        try:
            from_gguf = _side(env.python, "greedy", str(gguf), n, str(threads), ids)
        except RuntimeError as exc:
            why = str(exc).rsplit(": ", 1)[-1]
            rows.append(
                {**base, "meshd_source": "gguf", "identical": None, "note": f"unsupported: {why}"}
            )
            continue
        rows.append(
            {
                **base,
                "meshd_source": "gguf",
                **_agreement(from_gguf, theirs),
                "meshd_tokens": from_gguf,
                "llamacpp_tokens": theirs,
            }
        )
    return rows


# -- quality: perplexity and top-1 on the same ids ---------------------------------------
def _quality_model(python: str, name: str) -> pathlib.Path:
    """A GGUF path as given, or scripts/fetch_models' cached (or fetched) file for a name."""
    if name.endswith(".gguf"):
        return pathlib.Path(name)
    out = subprocess.run(
        [python, str(FETCH_MODELS), name], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/fetch_models {name}: {out.stderr.strip()[-500:]}")
    return pathlib.Path(out.stdout.strip().splitlines()[-1])


def meshd_perplexity(env: Env, gguf: pathlib.Path, *args: str) -> dict[str, Any]:
    """One `meshd bench perplexity --model gguf ... --json` process."""
    return _meshd_json([env.meshd, "bench", "perplexity", "--model", str(gguf), *args, "--json"])


def top1_agreement(a: list[int], b: list[int]) -> float:
    """The share of positions whose argmax ids are equal."""
    if len(a) != len(b) or not a:
        raise ValueError(f"top-1 lists of {len(a)} and {len(b)} positions")
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def quality_rows(
    env: Env,
    models: list[str],
    text: pathlib.Path,
    tokens: int,
    quantizations: list[str],
    threads: int,
) -> list[dict[str, Any]]:
    """Per model file: llama.cpp's perplexity and meshd's at each quantization, same ids."""
    rows: list[dict[str, Any]] = []
    for name in models:
        gguf = _quality_model(env.python, name)
        first = meshd_perplexity(env, gguf, "--text", str(text), "--tokens", str(tokens))
        ids_json = env.work / "quality" / f"{gguf.stem}.{tokens}.ids.json"
        ids_json.parent.mkdir(parents=True, exist_ok=True)
        ids_json.write_text(json.dumps(first["tokens"]) + "\n")
        extra_bufts = True
        try:
            theirs = llamacpp.score(env.lc, gguf, ids_json, threads, extra_bufts)
        except RuntimeError as exc:  # e.g. AMX faulting in a VM: plain CPU buffers instead
            log(f"{gguf.name}: meshd-score failed ({str(exc).splitlines()[0]}); --no-extra-bufts")
            extra_bufts = False
            theirs = llamacpp.score(env.lc, gguf, ids_json, threads, extra_bufts)
        if theirs["tokens"] != first["tokens"]:
            raise RuntimeError(f"{gguf.name}: meshd-score scored other ids than it was given")
        # llama.cpp under its other attention settings (no flash attention, fp32 KV): its
        # agreement with itself is the floor of what any engine's agreement with it can show.
        reference = llamacpp.score(
            env.lc, gguf, ids_json, threads, extra_bufts, ("--flash-attn", "off", "--kv-f32")
        )
        self_agreement = top1_agreement(theirs["top1"], reference["top1"])
        log(
            f"{gguf.name}: llama.cpp ppl {theirs['ppl']:.4f} (default), {reference['ppl']:.4f} "
            f"(no flash attention, fp32 KV); top-1 agreement with itself {self_agreement:.3f}"
        )
        for quant in quantizations:
            args = ["--token-ids", str(ids_json), "--threads", str(threads)]
            if quant != "default":
                args += ["--quantization", quant]
            ours = meshd_perplexity(env, gguf, *args)
            rows.append(
                {
                    "kind": "quality",
                    "model": gguf.name,
                    "sha256": _sha256(gguf),
                    "text": str(text),
                    "bos_added": first.get("bos_added"),
                    "n": ours["n"],
                    "meshd_quantization": ours["quantization"],
                    "meshd_default": quant == "default",
                    "meshd_ppl": ours["ppl"],
                    "llamacpp_ppl": theirs["ppl"],
                    "ratio": ours["ppl"] / theirs["ppl"],
                    "top1_agreement": top1_agreement(ours["top1"], theirs["top1"]),
                    "llamacpp_fp32_kv_ppl": reference["ppl"],
                    "top1_agreement_fp32_kv": top1_agreement(ours["top1"], reference["top1"]),
                    "llamacpp_self_agreement": self_agreement,
                    "llamacpp_build": env.lc.build,
                    "llamacpp_extra_bufts": extra_bufts,
                    "ids_file": str(ids_json),
                }
            )
            log(
                f"{gguf.name}: meshd {ours['quantization']} ppl {ours['ppl']:.4f}, llama.cpp "
                f"{theirs['ppl']:.4f}, top-1 agreement {rows[-1]['top1_agreement']:.3f}"
            )
    return rows


def ggml_rows(env: Env, seconds: float) -> list[dict[str, Any]]:
    """ggml_mm.c's per-call timings of ggml_mul_mat (one JSON row per case)."""
    return [
        {"kind": "ggml", "llamacpp_build": env.lc.build, **row}
        for row in llamacpp.ggml_mm(env.lc, seconds)
    ]


# -- output -------------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    return "—" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        out += [
            "| model | precision | threads | meshd from | llama.cpp tok/s | meshd tok/s | ratio "
            "| meshd fp32 tok/s | fp32 ratio | note |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in decode:
            out.append(
                f"| {r['model']} | {r['precision']} | {r['threads']} | {r['meshd_source']} "
                f"({r['meshd_quantization']}) | {_fmt(r['llamacpp_tok_s'])} | "
                f"{_fmt(r['meshd_tok_s'])} | {_fmt(r['ratio'])} | "
                f"{_fmt(r.get('meshd_fp32_tok_s'))} | {_fmt(r.get('ratio_fp32'))} | "
                f"{r.get('note', '')} |"
            )
    pipe = [r for r in rows if r["kind"] == "pipeline"]
    if pipe:
        out += [
            "",
            "| model | precision | threads/stage | RTT ms | llama.cpp RPC tok/s "
            "| meshd 2 stages tok/s | ratio | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in pipe:
            out.append(
                f"| {r['model']} | {r['precision']} | {r['threads']} | {_fmt(r['rtt_ms'])} | "
                f"{_fmt(r['llamacpp_tok_s'])} | {_fmt(r['meshd_tok_s'])} | {_fmt(r['ratio'])} | "
                f"{r.get('note', '')} |"
            )
    agree = [r for r in rows if r["kind"] == "agreement"]
    if agree:
        out += [
            "",
            "| model | llama.cpp file | meshd from | tokens | identical "
            "| tokens until divergence | share identical | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in agree:
            out.append(
                f"| {r['model']} | {r['precision']}.gguf | {r['meshd_source']} | {r['tokens']} | "
                f"{_fmt(r['identical'])} | {_fmt(r.get('tokens_until_divergence'))} | "
                f"{_fmt(r.get('share_identical'))} | {r.get('note', '')} |"
            )
    quality = [r for r in rows if r["kind"] == "quality"]
    if quality:
        out += [
            "",
            "| GGUF file | ids | meshd quantization | meshd ppl | llama.cpp ppl | ratio "
            "| top-1 agreement |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in quality:
            default = " (default)" if r["meshd_default"] else ""
            out.append(
                f"| {r['model']} | {r['n']} | {r['meshd_quantization']}{default} | "
                f"{r['meshd_ppl']:.3f} | {r['llamacpp_ppl']:.3f} | {r['ratio']:.3f} | "
                f"{100 * r['top1_agreement']:.1f} % |"
            )
    mm = [r for r in rows if r["kind"] == "ggml" and "median_us" in r]
    if mm:
        out += [
            "",
            "| weight out×in | type | weight KB | batch | threads | hot µs/call (median) "
            "| hot GB/s | cold µs/call (median) | cold GB/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mm:
            out.append(
                f"| {r['out']}×{r['in']} | {r['type']} | {r['weight_bytes'] / 1e3:.0f} | "
                f"{r['batch']} | {r['threads']} | {r['median_us']:.1f} | {r['gb_s']:.1f} | "
                f"{_fmt(r.get('cold_median_us'))} | {_fmt(r.get('cold_gb_s'))} |"
            )
    return "\n".join(out)


def _git_commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def _cpu() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _partial(out: pathlib.Path | None, head: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The rows so far, so that an interrupted run still leaves what it measured."""
    if out is not None:
        now = {"load_average_now": [round(x, 2) for x in os.getloadavg()], "interrupted": True}
        report = {"conditions": {**head, **now}, "rows": rows}
        out.write_text(json.dumps(report, indent=1) + "\n")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench_llamacpp", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument(
        "--llamacpp-version",
        default=DEFAULT_VERSION,
        help="llama-cpp-python sdist version (default %(default)s)",
    )
    p.add_argument(
        "--cache-dir",
        type=pathlib.Path,
        default=None,
        help="build and model cache (default ~/.cache/meshd-llamacpp/VERSION)",
    )
    p.add_argument(
        "--llamacpp-dir",
        type=pathlib.Path,
        default=None,
        help="an existing llama.cpp source tree with its build in build/bin (or the cache layout)",
    )
    p.add_argument("--jobs", type=int, default=2, help="cmake build jobs (default 2)")
    p.add_argument(
        "--llamacpp-build",
        choices=sorted(llamacpp.BUILDS),
        default="native",
        help="native (-DGGML_NATIVE=ON) or avx2 (no AVX-512/AVX-VNNI/AMX), its own build dir",
    )
    p.add_argument(
        "--python",
        default=str(REPO / ".venv" / "bin" / "python"),
        help="meshd's Python (runs the converter too)",
    )
    p.add_argument(
        "--meshd", default=str(REPO / ".venv" / "bin" / "meshd"), help="the meshd command"
    )
    p.add_argument("--models", default=",".join(MODELS), help="comma list of builtin, large")
    p.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="comma list of f32, q8_0, q4_0"
    )
    p.add_argument("--threads", default="1,2", help="decode thread counts (default 1,2)")
    p.add_argument(
        "--pipeline-threads",
        type=int,
        default=1,
        help="threads per stage in the 2-node rows (default 1: meshd's local pipeline gives each stage 1)",
    )
    p.add_argument("--rtt-ms", default="0,20", help="2-node RTTs in ms (default 0,20)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per run (default 128)")
    p.add_argument("--quick", action="store_true", help="1 round of 32 tokens")
    p.add_argument(
        "--parts",
        default="decode,pipeline,gguf",
        help="comma list of decode, pipeline, gguf, quality, ggml",
    )
    p.add_argument(
        "--quality-models",
        default="smollm2-135m",
        help="quality: comma list of .gguf paths or scripts/fetch_models names",
    )
    p.add_argument(
        "--text",
        type=pathlib.Path,
        default=DEFAULT_TEXT,
        help="quality: the text whose first ids are scored (default docs/bench/prose.txt)",
    )
    p.add_argument(
        "--quality-tokens", type=int, default=256, help="quality: ids scored (default 256)"
    )
    p.add_argument(
        "--quality-quantizations",
        default="default,none",
        help="quality: meshd's --quantization values (default: the daemon's choice, none)",
    )
    p.add_argument(
        "--ggml-seconds", type=float, default=0.4, help="ggml: seconds per case (default 0.4)"
    )
    p.add_argument("--json", action="store_true", help="print JSON rows, one per line")
    p.add_argument(
        "--render",
        type=pathlib.Path,
        nargs="+",
        default=None,
        help="measure nothing: print the tables of these --out reports, merged",
    )
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="also write the whole report as JSON here"
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.render:
        reports = [json.loads(path.read_text()) for path in args.render]
        print(markdown([row for report in reports for row in report["rows"]]))
        for path, report in zip(args.render, reports, strict=True):
            c = report["conditions"] or {}
            print(
                f"\n{path}: {c.get('command', 'interrupted run')}, load average "
                f"{c.get('load_average_before')} → "
                f"{c.get('load_average_after', c.get('load_average_now'))}"
            )
        return 0
    cache = (
        args.cache_dir or pathlib.Path.home() / ".cache" / "meshd-llamacpp" / args.llamacpp_version
    )
    tokens = args.tokens or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    threads = [int(t) for t in _csv(args.threads)]
    rtts = [float(r) for r in _csv(args.rtt_ms)]
    parts = set(_csv(args.parts))
    precisions = _csv(args.precisions)
    if unknown := set(precisions) - set(PRECISIONS):
        raise SystemExit(f"unknown precisions: {', '.join(sorted(unknown))}")
    started, load_before = time.perf_counter(), os.getloadavg()
    head = {
        "kind": "conditions",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/bench_llamacpp", *argv]),
        "load_average_before": [round(x, 2) for x in load_before],
    }
    lc = llamacpp.ensure_built(
        args.llamacpp_version,
        cache,
        args.llamacpp_dir,
        args.python,
        args.jobs,
        args.llamacpp_build,
    )
    env = Env(lc, args.python, args.meshd, cache / "models", tokens, rounds)
    env.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    if "quality" in parts:
        rows += quality_rows(
            env,
            _csv(args.quality_models),
            args.text,
            args.quality_tokens,
            _csv(args.quality_quantizations),
            max(threads),
        )
        _partial(args.out, head, rows)
    if "ggml" in parts:
        rows += ggml_rows(env, args.ggml_seconds)
        _partial(args.out, head, rows)
    model_parts = parts & {"decode", "pipeline", "gguf"}
    decode_quants = meshd_quant_choices(meshd_help(env, "decode")) if model_parts else set()
    pipeline_quants = meshd_quant_choices(meshd_help(env, "pipeline")) if model_parts else set()
    for name in _csv(args.models) if model_parts else []:
        model = prepare_model(name, env)
        model.gguf = {p: g for p, g in model.gguf.items() if p in precisions}
        if "decode" in parts:
            gguf_ok, why = meshd_gguf_decode_ok(model, env, threads[0])
            if not gguf_ok:
                notes[f"{name}: meshd bench decode --model f32.gguf"] = why
            for n in threads:
                rows += decode_rows(model, n, env, decode_quants, gguf_ok)
                _partial(args.out, head, rows)
        if "pipeline" in parts:
            rows += pipeline_rows(model, env, rtts, args.pipeline_threads, pipeline_quants)
            _partial(args.out, head, rows)
        if "gguf" in parts:
            rows += agreement_rows(model, env, max(threads))
            _partial(args.out, head, rows)
    conditions = {
        **head,
        "meshd_commit": _git_commit(),
        "llamacpp": f"llama-cpp-python {args.llamacpp_version} sdist, vendor/llama.cpp ({lc.commit()})",
        "llamacpp_bin_dir": str(lc.bin_dir),
        "llamacpp_build": lc.build,
        "cpu": _cpu(),
        "cpus": os.cpu_count(),
        "tokens": tokens,
        "rounds": rounds,
        "meshd_quantization_flag": {
            "decode": sorted(decode_quants),
            "pipeline": sorted(pipeline_quants),
        },
        "unsupported_notes": notes,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.out is not None:
        args.out.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")
    if args.json:
        for row in [*rows, conditions]:
            print(json.dumps(row))
    else:
        print(markdown(rows))
        print()
        print(json.dumps(conditions, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
