"""Which device a node computes on, and how much memory that device offers.

The capacity a node reports to the planner is the memory of the device it uses: free GPU memory
on CUDA, available RAM on CPU (and on Apple's unified-memory MPS).
"""

from __future__ import annotations

import os
import pathlib

import torch

_MEMINFO = pathlib.Path("/proc/meminfo")


def pick_device(override: str | torch.device | None = None) -> torch.device:
    """CUDA if present, then MPS, else CPU; `override` ("cpu", "cuda:1", ...) wins."""
    if override is not None:
        device = torch.device(override)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {override!r} requested but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_memory_bytes(device: str | torch.device) -> int:
    """Memory available to models on `device`, in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, else physical pages x page size."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
