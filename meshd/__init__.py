"""meshd: pool the machines of a home or lab into one LLM server."""

import os as _os
import sys as _sys

# OpenMP workers spin for a few milliseconds after a parallel region, then sleep. Waking a
# sleeping worker costs more than a decode step's matmul gains from it (on virtual machines
# above all), so workers that never spin leave a second core idle, and workers that sleep
# between two tokens' passes pay that wake-up every token. Spinning workers stall every
# parallel region on a machine whose cores are busy with other work: a stage's
# `ThreadGovernor` falls back to one thread there (figures: docs/model-runtime.md, "Threads").
# libgomp reads these once, when torch loads it, so they are set here, before any meshd module
# imports torch; an environment that sets either keeps its own. (A program that imported torch
# before meshd keeps its policy; `configure_threads` warns.)
OMP_POLICY_SET_IN_TIME = "torch" not in _sys.modules or "OMP_WAIT_POLICY" in _os.environ
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    # libgomp's default count, which it estimates at ~3 ms; spinning only while the policy
    # is PASSIVE would otherwise be none at all.
    _os.environ["GOMP_SPINCOUNT"] = "300000"

__version__ = "0.1.0"
