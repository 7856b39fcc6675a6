"""`Decision`: what one of `auto`'s decisions weighed and chose, for whoever watches it.

`AutoProposer.trace`, when set, receives one after every decision (scripts/auto_trace.py
prints them); nothing in the decoding path reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision of `auto`: read-only."""

    log_length: int  # committed tokens when it was made
    choice: str  # the strategy chosen ("disabled": plain decoding)
    reason: str  # why (`AutoProposer.reason`)
    # Every weighed candidate: (expected seconds per token, width; 0 = it would not speculate).
    candidates: dict[str, tuple[float, int]]
