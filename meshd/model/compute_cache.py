"""A node's measured compute per layer and token, kept in its cache dir so a restart skips
the measurement (`cached_compute_ns`).

The planner needs each node's nanoseconds per layer and token; a node measures them at start
by loading a layer and timing passes (`meshd.node.stage_slot.measure_compute_ns`), which on a
busy machine takes seconds and touches layer 0's pages whatever the node will serve. The figure
depends only on what `ComputeKey` names (the model, the threads, the formats, the kernel
library that multiplies, the CPU and torch), so it is stored under that key in
`<model_cache_dir>/compute/` (`model_cache_dir` is `state_dir` unless set) and a start with an
equal key reads it. A different file has another model id, a new meshd build of the kernels
another library name, another CPU another model name: each is measured anew. Deleting the
directory (or the state dir) makes the next start measure again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import platform
import time
from collections.abc import Callable

import msgspec
import torch

from meshd.model.quant import BLOCK_QUANTIZATIONS

log = logging.getLogger(__name__)


class ComputeKey(msgspec.Struct, frozen=True):
    """Everything a measured compute figure depends on; equal keys, equal measurements."""

    model_id: str
    threads: int
    quantization: str
    dtype: str
    kv_dtype: str
    device: str
    kernels: str  # the library that multiplies (its file name carries its ISA and source hash)
    cpu: str
    torch: str
    # "files": measured on the model's own weights; "shapes": on random weights of its shapes
    # (a `mesh:ID` node before it fetched any).
    weights: str = "files"


class _Entry(msgspec.Struct):
    key: ComputeKey
    compute_ns: int
    measured_unix_s: float


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".strip()


def kernel_library(quantization: str, device: torch.device) -> str:
    """(blocking: may build the library) The kernel library a stage at `quantization`
    multiplies with: its file name, or "torch" where torch's own ops do."""
    if device.type != "cpu":
        return "torch"
    if quantization == "gguf" or quantization in BLOCK_QUANTIZATIONS:
        from meshd.model.kernels.blocks import block_kernels

        return block_kernels().path.name
    from meshd.model.kernels import cpu_kernels

    kernels = cpu_kernels()
    return kernels.path.name if kernels is not None else "torch"


def compute_key(
    model_id: str,
    *,
    threads: int,
    quantization: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    weights: str = "files",
) -> ComputeKey:
    """(blocking) The key of a measurement on `threads` intra-op threads."""
    return ComputeKey(
        model_id=model_id,
        threads=threads,
        quantization=quantization,
        dtype=str(dtype),
        kv_dtype=str(kv_dtype),
        device=str(device),
        kernels=kernel_library(quantization, device),
        cpu=cpu_model(),
        torch=str(torch.__version__),
        weights=weights,
    )


def _path(cache_dir: pathlib.Path, key: ComputeKey) -> pathlib.Path:
    name = hashlib.sha256(msgspec.json.encode(key)).hexdigest()[:24]
    return cache_dir / "compute" / f"{name}.json"


def read_compute_ns(cache_dir: pathlib.Path, key: ComputeKey) -> int | None:
    """The figure stored for `key` (None: none, or a file that is not one for this key)."""
    try:
        entry = msgspec.json.decode(_path(cache_dir, key).read_bytes(), type=_Entry)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return entry.compute_ns if entry.key == key and entry.compute_ns > 0 else None


def write_compute_ns(cache_dir: pathlib.Path, key: ComputeKey, compute_ns: int) -> None:
    """Store `compute_ns` for `key` (written whole under a temporary name, then renamed); a
    directory that cannot be written is logged, and the next start measures again."""
    path = _path(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(_Entry(key, compute_ns, time.time())))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot cache the compute measurement in %s: %s", path.parent, exc)


def cached_compute_ns(
    cache_dir: pathlib.Path | None, key: ComputeKey, measure: Callable[[], int]
) -> tuple[int, bool]:
    """(blocking) `key`'s figure from the cache, else `measure()` stored there; and whether it
    came from the cache. No cache dir: always measured."""
    if cache_dir is not None:
        known = read_compute_ns(cache_dir, key)
        if known is not None:
            return known, True
    compute_ns = measure()
    if cache_dir is not None:
        write_compute_ns(cache_dir, key, compute_ns)
    return compute_ns, False
