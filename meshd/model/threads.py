"""How many cores a stage computes with (`configure_threads`), and why that is safe.

Batch-1 decode runs a few hundred small ops per token; only the weight matmuls (and attention
over long contexts) are big enough to share between cores. Three rules make more threads pay
where they can and never cost where they cannot:

- OpenMP workers spin for a few milliseconds, then sleep (`GOMP_SPINCOUNT`, set by
  `meshd/__init__.py` before torch loads, unless the environment says otherwise): the gaps
  between a step's products, and between one token's pass and the next, are shorter than that,
  so a second core stays awake while a stage decodes, and sleeps once it is idle.
- A stage's `ThreadGovernor` (meshd/model/governor.py) measures its passes on its threads and
  on one and runs on whichever is faster now: on a busy machine any spinning partner stalls
  every parallel region, and one thread wins (figures: docs/model-runtime.md, "Threads").
- A model whose matrices are too small to split (`MIN_SHARED_MATRIX_BYTES`) computes on one
  thread: a fork and a join cost more than half of such a matrix-vector product.
"""

from __future__ import annotations

import logging
import os

import torch

import meshd
from meshd.model.config import ModelConfig
from meshd.model.stage import layer_bytes

log = logging.getLogger(__name__)

# Below this many bytes per weight matrix (a layer's four, on average) one core finishes a
# matrix-vector product in less time than a fork and join of a second one pays back
# (docs/model-runtime.md, "Threads").
MIN_SHARED_MATRIX_BYTES = 1 << 18


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def useful_threads(
    threads: int,
    config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
) -> int:
    """The intra-op threads a stage of `config` should use when given `threads` (0 = all)."""
    wanted = threads if threads > 0 else available_cores()
    if config is None or wanted == 1:
        return wanted
    vectors = 2 * config.hidden_size * torch.empty(0, dtype=dtype).element_size()
    # A GGUF file's own blocks hold about what q4_0 holds (4.5 to 8.5 bits a weight).
    scheme = "q4_0" if quantization == "gguf" else quantization
    per_matrix = (layer_bytes(config, dtype, scheme) - vectors) / 4
    return wanted if per_matrix >= MIN_SHARED_MATRIX_BYTES else 1


def configure_threads(
    threads: int = 0,
    config: ModelConfig | None = None,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
) -> int:
    """Set torch's intra-op threads for stage compute; returns the number set.

    `threads` 0 means every core this process may use. With `config` (and the stage's dtype
    and quantization), a model too small to gain from more than one core gets one.
    """
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = all cores), got {threads}")
    n = useful_threads(threads, config, dtype, quantization)
    if n > 1 and not meshd.OMP_POLICY_SET_IN_TIME:
        log.warning(
            "torch was imported before meshd without OMP_WAIT_POLICY: its OpenMP workers spin "
            "when idle, and %d threads may decode slower than 1 on a busy machine",
            n,
        )
    torch.set_num_threads(n)
    return n
