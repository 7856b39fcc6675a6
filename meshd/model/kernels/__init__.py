"""meshd's own CPU kernel: an int8 matrix product for x86 CPUs with AVX-512 VNNI.

At batch 1 a projection streams its whole matrix from memory, so its speed is the memory
bandwidth the kernel reaches. fbgemm's dynamic linear (torch's fastest int8 product here) reaches
about 12 GB/s on one core of the Xeon we measure on, where a plain stream reaches 16.8, and its
per-row mapping (which keeps a row's result independent of its batch) adds eleven small torch
operations per call. `quant_mm.c` quantizes each row itself, streams weights packed for
VPDPBUSD and adds the residual in the same call: 1.27x fbgemm's products on one core, 1.39x on
two (figures and commands in docs/model-runtime.md). No library in meshd's dependencies has
such a kernel, which is why it is written here (docs/model-runtime.md "Why a hand-written
kernel"). The same library runs every decoder layer of a CPU stage in one call
(`meshd_layers`), for int8, int4 and fp32 matrices: torch has no fused decoder-layer call,
and between its ~15 small operations per layer a decode step spent ~1 ms a token.

The C source ships in the package and is compiled once per machine with the system's C
compiler (`cc`, or `CC`) into a cache directory (`MESHD_KERNEL_DIR`, else systemd's
`$CACHE_DIRECTORY/kernels`, else `$XDG_CACHE_HOME/meshd/kernels`, else
`~/.cache/meshd/kernels`, else a temporary directory),
then loaded with ctypes, which releases the GIL for the call. Without a compiler, on another
CPU, or with `MESHD_QUANT_KERNELS=torch`, int8 stages run fbgemm and fp32 stages MKL, layer by
layer.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshd.model import process_env

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_mm.c")
_FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-fopenmp",
    # The epilogue's multiplies and adds stay separate: a fused multiply-add chosen by the
    # compiler in one code path and not another would break the rows' batch independence.
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
)
# The CPU features the compiled code uses.
_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# Output channels per packed tile and input positions per VPDPBUSD lane (quant_mm.c's TILE).
TILE = 64
QUAD = 4
# The process's environment variables (not config keys), named in one torch-free module.
KERNELS_ENV = process_env.KERNELS_ENV
KERNEL_DIR_ENV = process_env.KERNEL_DIR_ENV
BLOCK_KERNELS_ENV = process_env.BLOCK_KERNELS_ENV
PROCESS_ENV = process_env.PROCESS_ENV
# What `MESHD_QUANT_KERNELS` may say: `auto` (these kernels where they run) or `torch`
# (torch's: fbgemm for int8, int4pack for int4).
CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: its C entry points (ctypes functions) for int8 and int4."""

    mm: Any
    pack: Any
    int4_mm: Any
    int4_pack: Any
    attend: Any
    layers: Any  # meshd_layers: every decoder layer of a stage in one call (`LayerArgs`)
    f32_mm: Any  # meshd_f32_mm: the fp32 product `meshd_layers` runs for fp32 stages
    path: Path


class MatrixArgs(ctypes.Structure):
    """quant_mm.c's `meshd_matrix`: a packed int8 (kind 8) or int4 (kind 4) matrix, or an fp32
    one read as `[in][layout]` (kind 32) or `[out][layout]` (kind 33)."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("layout", ctypes.c_int64),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("sums", ctypes.c_void_p),
    ]


class LayerArgs(ctypes.Structure):
    """quant_mm.c's `meshd_layer`: one decoder layer's matrices, norms and biases (NULL: none)."""

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
    """quant_mm.c's `meshd_dims`."""

    _fields_ = [
        ("n_heads", ctypes.c_int64),
        ("n_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("tiny", ctypes.c_float),
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
    return build_library("quant_mm", [_SOURCE], _FLAGS, directory, timeout_s=120)


def build_library(
    stem: str, sources: list[Path], flags: tuple[str, ...], directory: Path, timeout_s: float
) -> Path:
    """`sources` compiled with `flags` into `directory` as `STEM-HASH.so` (built there first if
    missing); raises on failure.

    Named by the sources' and flags' hash: a new meshd builds its own, and a machine that
    built it once needs no compiler again.
    """
    digest = hashlib.sha256()
    for src in sources:
        digest.update(src.read_bytes())
    digest.update(" ".join(flags).encode())
    path = directory / f"{stem}-{digest.hexdigest()[:16]}.so"
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


def _check_private(path: Path) -> None:
    """Refuse a directory or library another user owns or may write: loading it would run
    their code (the temporary-directory fallback is shared)."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{path} is not this user's alone (owner {st.st_uid}, mode {st.st_mode:o})")


def _load(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    if lib.meshd_int8_abi() != 8:
        raise OSError(f"{path}: unexpected kernel ABI")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    mm = lib.meshd_int8_mm
    f32 = ctypes.c_float
    mm.argtypes = [p, i64, i64, p, p, p, i64, i64, p, p, p, f32, ctypes.c_int, f32, ctypes.c_int]
    mm.restype = ctypes.c_int
    pack = lib.meshd_int8_pack
    pack.argtypes = [p, i64, i64, i64, p]
    pack.restype = None
    int4_mm = lib.meshd_int4_mm
    int4_mm.argtypes = mm.argtypes  # the same arguments, the int4 layout's
    int4_mm.restype = ctypes.c_int
    int4_pack = lib.meshd_int4_pack
    int4_pack.argtypes = [p, i64, i64, p]
    int4_pack.restype = None
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
    return CpuKernels(mm, pack, int4_mm, int4_pack, attend, layers, f32_mm, path)


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


def packed_int4_bytes(in_features: int, out_features: int, group: int) -> int:
    """Bytes of an int4 matrix packed for the kernel: half a byte per weight in tiles of 64
    channels, a bf16 scale and offset per group, and a sum per padded channel."""
    channels = -(-out_features // TILE) * TILE
    return channels * in_features // 2 + channels * (in_features // group) * 4 + 4 * channels


def packed_bytes(in_features: int, out_features: int) -> int:
    """Bytes of a matrix packed for the kernel: tiles of 64 channels, the input rounded up to
    4, and a scale and a code sum per padded channel."""
    channels = -(-out_features // TILE) * TILE
    return channels * (-(-in_features // QUAD) * QUAD) + 8 * channels
