"""Environment variables of the process that are not config keys (the config loader skips
them): which kernels run and where they are built. Named apart from `meshd.model.kernels`, which
imports torch, so that loading the config stays free of it."""

from __future__ import annotations

KERNELS_ENV = "MESHD_QUANT_KERNELS"
KERNEL_DIR_ENV = "MESHD_KERNEL_DIR"
# The GGUF block kernels' path (meshd.model.kernels.blocks).
BLOCK_KERNELS_ENV = "MESHD_BLOCK_KERNELS"
PROCESS_ENV = (KERNELS_ENV, KERNEL_DIR_ENV, BLOCK_KERNELS_ENV)
