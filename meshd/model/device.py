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


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all the machine's where unknown)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def set_compute_threads(threads: int) -> int:
    """Run torch's intra-op work on `threads` threads (0 = every usable core); returns how many.

    The one place a daemon sets its compute threads (the `threads` config key).
    """
    count = threads if threads > 0 else usable_cores()
    torch.set_num_threads(count)
    return count
