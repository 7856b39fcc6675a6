"""llama.cpp's side: fetch the source pip knows, build the tools, convert, quantize, run.

llama.cpp comes from the llama-cpp-python sdist (it vendors llama.cpp's source under
vendor/llama.cpp), fetched with pip, so only a package registry is needed. The build goes to
a cache directory and is reused while its binaries are there.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = ("llama-bench", "llama-quantize")
# The builds `--llamacpp-build` selects: cmake flags past the common ones, and the build
# directory. "native" is what this CPU offers (AVX-512, VNNI, AMX where present); "avx2" is
# what an AVX2-only x86 CPU runs (Haswell to Skylake desktops, AMD before Zen 4): no AVX-512,
# no AVX-VNNI, no AMX.
BUILDS: dict[str, tuple[str, list[str]]] = {
    "native": ("build", ["-DGGML_NATIVE=ON"]),
    "avx2": (
        "build-avx2",
        [
            "-DGGML_NATIVE=OFF",
            "-DGGML_AVX=ON",
            "-DGGML_AVX2=ON",
            "-DGGML_FMA=ON",
            "-DGGML_F16C=ON",
            "-DGGML_BMI2=ON",
            "-DGGML_AVX_VNNI=OFF",
            "-DGGML_AVX512=OFF",
            "-DGGML_AVX512_VBMI=OFF",
            "-DGGML_AVX512_VNNI=OFF",
            "-DGGML_AVX512_BF16=OFF",
            "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF",
        ],
    ),
}
CONVERTER_PRE_TOKENIZER = "gpt-2"  # meshd's byte-level BPE splits text like GPT-2's


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (for the converter) and its binaries."""

    source: pathlib.Path
    bin_dir: pathlib.Path
    rpc_server: pathlib.Path
    greedy: pathlib.Path
    score: pathlib.Path
    ggml_mm: pathlib.Path
    build: str = "native"

    def tool(self, name: str) -> pathlib.Path:
        return self.bin_dir / name

    def commit(self) -> str:
        """The llama.cpp build's commit/number, as llama-bench reports it (best effort)."""
        out = subprocess.run(
            [str(self.tool("llama-bench")), "--version"], capture_output=True, text=True
        )
        text = (out.stdout + out.stderr).strip()
        return text.splitlines()[0] if text else "unknown"


def log(msg: str) -> None:
    print(f"[bench_llamacpp] {msg}", file=sys.stderr, flush=True)


def run_logged(cmd: list[str], log_path: pathlib.Path, **kw: object) -> None:
    """Run a long build step with its output in a log file; raise with the tail on failure."""
    log("$ " + " ".join(cmd))
    with log_path.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode  # type: ignore[call-overload]
    if rc != 0:
        tail = log_path.read_text().splitlines()[-20:]
        raise RuntimeError(f"{cmd[0]} failed (rc {rc}); see {log_path}:\n" + "\n".join(tail))


def source_in(directory: pathlib.Path) -> pathlib.Path | None:
    """The llama.cpp source tree at `directory` or unpacked below it (an sdist's
    `*/vendor/llama.cpp`), or None."""
    if (directory / "convert_hf_to_gguf.py").is_file():
        return directory
    for candidate in sorted(directory.glob("*/vendor/llama.cpp")):
        if (candidate / "convert_hf_to_gguf.py").is_file():
            return candidate
    return None


def _bin_dir_in(directory: pathlib.Path, build_dir: str = "build") -> pathlib.Path | None:
    candidates = [directory / build_dir / "bin"]
    if build_dir == "build":
        candidates.append(directory / "bin")
    for candidate in candidates:
        if all((candidate / t).is_file() for t in TOOLS):
            return candidate
    return None


def _rpc_target(source: pathlib.Path) -> str:
    """The RPC server's cmake target: `ggml-rpc-server` in newer trees, `rpc-server` before."""
    for cmake in (
        source / "tools" / "rpc" / "CMakeLists.txt",
        source / "examples" / "rpc" / "CMakeLists.txt",
    ):
        if cmake.is_file():
            found = re.search(r"set\(TARGET\s+([\w-]+)\)", cmake.read_text())
            if found:
                return found.group(1)
    return "rpc-server"


def _fetch_source(version: str, cache: pathlib.Path, python: str) -> pathlib.Path:
    """pip download the llama-cpp-python sdist and unpack it into the cache."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-sdist-") as tmp:
        cmd = [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={version}",
            "-d",
            tmp,
        ]
        run_logged(cmd, cache / "fetch.log")
        (sdist,) = pathlib.Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    source = source_in(cache)
    if source is None:
        raise RuntimeError(f"no vendor/llama.cpp with convert_hf_to_gguf.py in {cache}")
    return source


def ensure_built(
    version: str,
    cache: pathlib.Path,
    llamacpp_dir: pathlib.Path | None,
    python: str,
    jobs: int,
    build_name: str = "native",
) -> LlamaCpp:
    """The llama.cpp to bench: `llamacpp_dir` as given, else the cache's, built if missing;
    `build_name` picks the build (BUILDS: native, avx2), each in its own directory."""
    build_dir, flags = BUILDS[build_name]
    root = llamacpp_dir or cache
    root.mkdir(parents=True, exist_ok=True)
    source = source_in(root)
    if source is None:
        if llamacpp_dir is not None:
            raise SystemExit(f"--llamacpp-dir {root}: no llama.cpp source tree found")
        source = _fetch_source(version, root, python)
    rpc = _rpc_target(source)
    bin_dir = _bin_dir_in(root, build_dir)
    if bin_dir is None or not (bin_dir / rpc).is_file():
        if llamacpp_dir is not None:
            raise SystemExit(f"--llamacpp-dir {root}: no build/bin with {', '.join(TOOLS)}, {rpc}")
        build = root / build_dir
        build_log = root / f"{build_dir}.log"
        log(f"building llama.cpp {version} in {build} (nice -n 15, -j{jobs}; ~15 min on 2 cores)")
        run_logged(
            [
                "nice",
                "-n",
                "15",
                "cmake",
                "-S",
                str(source),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                *flags,
                "-DGGML_RPC=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ],
            build_log,
        )
        run_logged(
            [
                "nice",
                "-n",
                "15",
                "cmake",
                "--build",
                str(build),
                f"-j{jobs}",
                "--target",
                *TOOLS,
                rpc,
            ],
            build_log,
        )
        bin_dir = build / "bin"
    return LlamaCpp(
        source=source,
        bin_dir=bin_dir,
        rpc_server=bin_dir / rpc,
        greedy=_ensure_tool(source, bin_dir, "greedy.cpp", "meshd-greedy"),
        score=_ensure_tool(source, bin_dir, "score.cpp", "meshd-score"),
        ggml_mm=_ensure_tool(source, bin_dir, "ggml_mm.c", "meshd-ggml-mm"),
        build=build_name,
    )


def _ensure_tool(source: pathlib.Path, bin_dir: pathlib.Path, name: str, tool: str) -> pathlib.Path:
    """Compile one of this directory's small tools (greedy.cpp, score.cpp: libllama;
    ggml_mm.c: ggml alone) against the build's libraries (seconds), unless up to date."""
    out = bin_dir / tool
    src = HERE / name
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    libs = ["-lllama", "-lggml", "-lggml-base"]
    compiler = ["g++", "-O2", "-std=c++17"]
    if name.endswith(".c"):
        libs, compiler = ["-lggml", "-lggml-base", "-lggml-cpu"], ["gcc", "-O2", "-std=c11"]
    if not (bin_dir / "libllama.so").is_file():
        raise RuntimeError(f"no libllama.so in {bin_dir} to link {tool} against")
    cmd = [
        *compiler,
        str(src),
        "-o",
        str(out),
        f"-I{source / 'include'}",
        f"-I{source / 'ggml' / 'include'}",
        f"-L{bin_dir}",
        *libs,
        f"-Wl,-rpath,{bin_dir}",
    ]
    run_logged(cmd, bin_dir / f"{tool}.log")
    return out


# -- conversion ---------------------------------------------------------------------------
# The converter, run with the pre-tokenizer fallback: llama.cpp recognises a BPE
# pre-tokenizer by hashing its output on a test string, and meshd's own tokenizer is not in
# its table; byte-level BPE with GPT-2's split regex is what it is.
_CONVERT = f"""
import runpy, sys
source = sys.argv[1]
sys.path.insert(0, source)
sys.path.insert(1, source + "/gguf-py")
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return {CONVERTER_PRE_TOKENIZER!r}
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [source + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_PIP_NAMES = {"yaml": "pyyaml", "google": "protobuf"}


def convert(
    lc: LlamaCpp, python: str, hf_dir: pathlib.Path, out: pathlib.Path, log_path: pathlib.Path
) -> None:
    """HF checkpoint → GGUF f32 with llama.cpp's own convert_hf_to_gguf.py.

    A module the converter imports but `python` lacks is installed with pip (a registry) and
    the conversion retried, a few times at most.
    """
    cmd = [
        python,
        "-c",
        _CONVERT,
        str(lc.source),
        str(hf_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
    ]
    for _ in range(4):
        try:
            run_logged(cmd, log_path)
            return
        except RuntimeError as exc:
            missing = re.findall(r"No module named '([\w.]+)'", str(exc))
            if not missing:
                raise
            name = missing[-1].split(".")[0]
            log(f"the converter needs {name}: pip install into {python}'s environment")
            run_logged([python, "-m", "pip", "install", _PIP_NAMES.get(name, name)], log_path)
    raise RuntimeError(f"conversion of {hf_dir} kept failing; see {log_path}")


def quantize(
    lc: LlamaCpp, f32: pathlib.Path, out: pathlib.Path, kind: str, log_path: pathlib.Path
) -> None:
    """GGUF f32 → `kind` (q8_0, q4_0) with llama-quantize, its default tensor choices."""
    run_logged([str(lc.tool("llama-quantize")), str(f32), str(out), kind.upper()], log_path)


# -- running ------------------------------------------------------------------------------
def bench(
    lc: LlamaCpp,
    gguf: pathlib.Path,
    tokens: int,
    threads: int,
    rpc: str | None = None,
    ngl: int = 0,
) -> tuple[float, dict[str, object]]:
    """One `llama-bench -p 0 -n tokens -t threads -r 1` run: tok/s and its JSON record."""
    cmd = [
        str(lc.tool("llama-bench")),
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(tokens),
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]
    if rpc is not None:
        cmd += ["--rpc", rpc, "-ngl", str(ngl)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    (record,) = json.loads(out.stdout)
    return float(record["avg_ts"]), record


def greedy_tokens(
    lc: LlamaCpp, gguf: pathlib.Path, prompt: list[int], n: int, threads: int
) -> list[int]:
    """llama.cpp's greedy continuation of `prompt` (token ids), exactly n tokens."""
    cmd = [str(lc.greedy), str(gguf), str(n), str(threads), ",".join(map(str, prompt))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"meshd-greedy failed:\n{out.stderr[-2000:]}")
    return [int(t) for t in out.stdout.strip().split(",")]


def score(
    lc: LlamaCpp,
    gguf: pathlib.Path,
    ids_json: pathlib.Path,
    threads: int,
    extra_bufts: bool,
    settings: tuple[str, ...] = (),
) -> dict[str, Any]:
    """score.cpp's report on the ids in `ids_json`: tokens, nll, ppl, top1 (as meshd's);
    `settings` are score.cpp's other flags (`--flash-attn off`, `--kv-f32`)."""
    cmd = [str(lc.score), str(gguf), str(ids_json), str(threads)]
    if not extra_bufts:
        cmd.append("--no-extra-bufts")
    cmd += settings
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def ggml_mm(lc: LlamaCpp, seconds: float) -> list[dict[str, Any]]:
    """ggml_mm.c's rows: ggml_mul_mat per-call microseconds per shape, type, batch, threads."""
    out = subprocess.run([str(lc.ggml_mm), str(seconds)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{lc.ggml_mm} failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def rpc_server(lc: LlamaCpp, threads: int, log_path: pathlib.Path) -> Iterator[int]:
    """`rpc-server` on 127.0.0.1 in a second process for the `with` block; yields its port."""
    port = free_port()
    cmd = [str(lc.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    with log_path.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{lc.rpc_server.name} exited; see {log_path}")
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{lc.rpc_server.name} did not listen; see {log_path}")
                time.sleep(0.1)
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def have_cmake() -> bool:
    return shutil.which("cmake") is not None and shutil.which("g++") is not None
