"""The daemon's `[stage]` table: how a stage host batches windows and when it refuses new
sessions. Apart from `meshd.stage.host` (which imports torch) so that loading the config,
and with it `meshd serve`'s start-up checks, stays free of torch."""

from __future__ import annotations

import math

import msgspec

# Prompt-prefix entries a coordinator's index holds per route (`prefix_cache_entries`).
PREFIX_CACHE_ENTRIES = 64


class StageHostConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a stage batches windows and when it refuses new sessions (the daemon's `[stage]`
    table). Validated on construction (ValueError naming the field)."""

    # Windows of several sessions waiting together are computed in one pass.
    batching: bool = True
    max_batch_tokens: int = 1024  # rows of one pass (a prefill chunk alone may exceed it)
    # Open sessions and queued windows beyond these are refused with `overloaded`, asking the
    # coordinator to retry after overload_retry_after_s.
    max_sessions: int = 64
    max_queued_windows: int = 256
    overload_retry_after_s: float = 1.0
    # Bytes of prefix-cache entries (KV kept from finished sessions) the stage may hold; they
    # also count against the KV budget, where live sessions evict them. 0: keep none.
    prefix_cache_bytes: int = 256 * 1024 * 1024
    # Entries this node, as coordinator, has each route's stages keep for it: its index of
    # prefixes per route holds this many, and every entry it drops (least recently used
    # first) the stages free (`dropped`). Bounds the stages' entries whatever their bytes.
    prefix_cache_entries: int = PREFIX_CACHE_ENTRIES

    def __post_init__(self) -> None:
        for name in (
            "max_batch_tokens",
            "max_sessions",
            "max_queued_windows",
            "prefix_cache_entries",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0")
        if not 0 < self.overload_retry_after_s < math.inf:
            raise ValueError("overload_retry_after_s must be a positive number of seconds")
