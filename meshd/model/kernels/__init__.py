"""meshd's own CPU kernels for x86 CPUs with AVX-512: every decoder layer of a stage in one call.

`layers.c` runs what `llama.decoder_layer` computes, layer after layer (`meshd_layers`): RMS
norms, products, RoPE, the cache write, attention one query row at a time, SwiGLU and the
residuals, for fp32 matrices (its own fp32 product) and for matrices in ggml's block formats
(the block library, `blocks.py`): torch has no fused decoder-layer call, and its small
operations per layer cost decode time (docs/model-runtime.md).

The C sources ship in the package and are compiled once per machine with the system's C
compiler (`cc`, or `CC`) into a cache directory (`MESHD_KERNEL_DIR`, else systemd's
`$CACHE_DIRECTORY/kernels`, else `$XDG_CACHE_HOME/meshd/kernels`, else
`~/.cache/meshd/kernels`, else a temporary directory), named by the hash of what the build
reads (`source_digest`), then loaded with ctypes, which releases the GIL for the call. Without
a compiler, on another CPU, or with `MESHD_QUANT_KERNELS=torch`, stages run layer by layer in
torch (block matrices still by the block library).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshd.model import process_env

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("layers.c")
_FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-fopenmp",
    # Multiplies and adds stay separate where the code does not fuse them itself: a fused
    # multiply-add chosen by the compiler in one code path and not another would break the
    # rows' batch independence.
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
)
# The CPU features the compiled code uses.
_NEEDS = ("avx512f", "avx512bw", "avx512vl")
# The process's environment variables (not config keys), named in one torch-free module.
KERNELS_ENV = process_env.KERNELS_ENV
KERNEL_DIR_ENV = process_env.KERNEL_DIR_ENV
BLOCK_KERNELS_ENV = process_env.BLOCK_KERNELS_ENV
PROCESS_ENV = process_env.PROCESS_ENV
# What `MESHD_QUANT_KERNELS` may say: `auto` (these kernels where they run) or `torch` (layer
# by layer in torch).
CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: its C entry points (ctypes functions)."""

    attend: Any  # meshd_attend: single query rows against an fp32 KV cache
    layers: Any  # meshd_layers: every decoder layer of a stage in one call (`LayerArgs`)
    f32_mm: Any  # meshd_f32_mm: the fp32 product `meshd_layers` runs for fp32 stages
    path: Path


class MatrixArgs(ctypes.Structure):
    """layers.c's `meshd_matrix`: an fp32 matrix read as `[in][layout]` (kind 32) or
    `[out][layout]` (kind 33), or ggml block tensors side by side (kind 64, `gguf_matrix`)."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("layout", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
    ]


class LayerArgs(ctypes.Structure):
    """layers.c's `meshd_layer`: one decoder layer's matrices, norms and biases (NULL: none)."""

    _fields_ = [
        ("qkv", MatrixArgs),
        ("o", MatrixArgs),
        ("gate_up", MatrixArgs),
        ("down", MatrixArgs),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("bqkv", ctypes.c_void_p),
        ("bo", ctypes.c_void_p),
        ("b_gate_up", ctypes.c_void_p),
        ("b_down", ctypes.c_void_p),
        ("window", ctypes.c_int64),
    ]


class DimsArgs(ctypes.Structure):
    """layers.c's `meshd_dims`."""

    _fields_ = [
        ("n_heads", ctypes.c_int64),
        ("n_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@functools.cache
def _cpu_flags() -> frozenset[str]:
    # Read once per process: the kernel writes /proc/cpuinfo anew (every core's entry) at each
    # read, and a stage asks for every matrix it loads.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cache_dir() -> Path:
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    if os.environ.get("CACHE_DIRECTORY"):  # systemd's CacheDirectory= (the shipped unit sets it)
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / "kernels"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "meshd" / "kernels"
    return Path.home() / ".cache" / "meshd" / "kernels"


def _compile(directory: Path) -> Path:
    """The compiled library in `directory` (built there first if missing); raises on failure."""
    return build_library("layers", [_SOURCE], _FLAGS, directory, timeout_s=120)


def build_library(
    stem: str, sources: list[Path], flags: tuple[str, ...], directory: Path, timeout_s: float
) -> Path:
    """`sources` compiled with `flags` into `directory` as `STEM-HASH.so` (built there first if
    missing); raises on failure.

    Named by the hash of the sources, the headers they include and the flags
    (`source_digest`): a new meshd builds its own, an edited header too, and a machine that
    built it once needs no compiler again.
    """
    path = directory / f"{stem}-{source_digest(sources, flags)}.so"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(directory)
    if path.exists():
        _check_private(path)
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, or CC) to build it")
    # Built under a temporary name and renamed: daemons starting together never load half a file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, "-o", tmp, *map(str, sources)],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout_s,
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled %s into %s", stem, path)
    return path


# `#include "name"`: a header beside the source (system headers, in <>, are the compiler's).
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_digest(sources: list[Path], flags: tuple[str, ...]) -> str:
    """The hash a built library is named by: every source, every local header it includes
    (transitively, each once), and the flags. A library built from other bytes than these
    files' is never taken for theirs."""
    digest = hashlib.sha256()
    seen: set[Path] = set()
    pending = list(sources)
    while pending:
        src = pending.pop(0)
        if src in seen:
            continue
        seen.add(src)
        text = src.read_bytes()
        digest.update(str(len(text)).encode() + b":" + text)
        included = (src.parent / name.decode() for name in _LOCAL_INCLUDE.findall(text))
        pending += [h for h in included if h.is_file()]  # (a missing one fails the build)
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()[:16]


def _check_private(path: Path) -> None:
    """Refuse a directory or library another user owns or may write: loading it would run
    their code (the temporary-directory fallback is shared)."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} is not this user's alone (owner {st.st_uid}, mode {st.st_mode:o})")


def _load(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    if lib.meshd_layers_abi() != 2:
        raise OSError(f"{path}: unexpected kernel ABI")
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    attend = lib.meshd_attend
    attend.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, f32, p, ctypes.c_int]
    attend.restype = ctypes.c_int
    layers = lib.meshd_layers
    layers.argtypes = [p, i64, p, p, i64, p, p, p, p, ctypes.c_int, ctypes.c_int]
    layers.restype = ctypes.c_int
    f32_mm = lib.meshd_f32_mm
    flag = ctypes.c_int
    f32_mm.argtypes = [p, i64, i64, p, i64, i64, flag, p, p, p, f32, flag, flag]
    f32_mm.restype = ctypes.c_int
    return CpuKernels(attend, layers, f32_mm, path)


def unavailable_reason() -> str | None:
    """Why this machine cannot run the kernel (None: it can, once compiled)."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in CHOICES:
        return f"{KERNELS_ENV}={choice!r} (expected one of {', '.join(CHOICES)})"
    if choice == "torch":
        return f"{KERNELS_ENV}=torch"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 Linux machine ({platform.system()} {platform.machine()})"
    missing = [f for f in _NEEDS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernel, compiled and loaded on first use; None where it cannot run here (logged)."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("stages use torch's kernels (meshd's do not run here: %s)", reason)
        return None
    # Loaded after torch, so its OpenMP library is torch's (one thread pool for both).
    assert torch.__version__
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"meshd-kernels-{os.getuid()}"):
        try:
            return _load(_compile(directory))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("meshd's CPU kernels: could not build or load in %s: %s", directory, detail)
    log.warning("stages use torch's kernels: meshd's could not be built")
    return None
