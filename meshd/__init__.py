"""meshd: pool the machines of a home or lab into one LLM server."""

import os as _os
import sys as _sys

# OpenMP workers sleep when idle instead of spinning: a spinning worker on a machine with other
# work stalls every parallel region (meshd/model/threads.py has the measurements). libgomp reads
# this once, when torch loads it, so it is set here, before any meshd module imports torch.
# (A program that imported torch before meshd keeps its policy; `configure_threads` warns.)
OMP_POLICY_SET_IN_TIME = "torch" not in _sys.modules or "OMP_WAIT_POLICY" in _os.environ
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
