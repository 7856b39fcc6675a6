"""meshd: pool the machines of a home or lab into one LLM server."""

import os as _os

# OpenMP workers sleep when idle instead of spinning: a spinning worker on a machine with other
# work stalls every parallel region (meshd/model/threads.py has the measurements). libgomp reads
# this once, when torch loads it, so it is set here, before any meshd module imports torch.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
