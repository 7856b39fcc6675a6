"""A node's compute per layer and token for the planner: measured at its first start, read
from its cache dir on later ones (`meshd.model.compute_cache`)."""

from __future__ import annotations

import logging
import time

import torch
import trio

from meshd.config import NodeConfig
from meshd.model.compute_cache import cached_compute_ns, compute_key
from meshd.node.basis import NodeBasis
from meshd.node.models import ModelFiles
from meshd.node.stage_slot import measure_compute_ns

log = logging.getLogger(__name__)

# Single-token passes timed to measure compute per layer and token (the fastest counts: the
# least disturbed by other work on the machine).
WARMUP_PASSES = 6


async def measure_or_cached(basis: NodeBasis, files: ModelFiles, config: NodeConfig) -> int:
    """`files`' compute per layer and token, in ns, on the node's device, formats and threads:
    the figure cached for exactly these (`ComputeKey`), else measured now and cached."""
    checkpoint = files.timing_checkpoint or files.checkpoint
    t0 = time.perf_counter()
    # Read here: torch's thread count as `configure_threads` set it (a worker thread's own
    # OpenMP setting may differ until it runs a parallel region).
    threads = torch.get_num_threads()

    def blocking() -> tuple[int, bool]:
        key = compute_key(
            files.shape.model_id,
            threads=threads,
            quantization=basis.quantization,
            dtype=basis.dtype,
            kv_dtype=basis.kv_dtype,
            device=basis.device,
            weights="files" if files.timing_checkpoint is None else "shapes",
        )
        return cached_compute_ns(
            config.model_cache_path(),
            key,
            lambda: measure_compute_ns(
                checkpoint,
                basis.device,
                basis.dtype,
                WARMUP_PASSES,
                quantization=basis.quantization,
                kv_dtype=basis.kv_dtype,
            ),
        )

    compute_ns, cached = await trio.to_thread.run_sync(blocking)
    log.info(
        "compute: %.2f ms per layer and token (%s in %.2f s)%s",
        compute_ns / 1e6,
        "read from the cache" if cached else "measured",
        time.perf_counter() - t0,
        f" for {files.name}" if files.name else "",
    )
    return compute_ns
