"""The prefix cache's counters for `meshctl status` and `/metrics`, in one place.

Two sides count: the coordinator (requests that looked up a prefix, hits, prompt positions
reused, misses that fell back to a full prefill) and the stage this node hosts (entries and
bytes held, hits and misses it served, evictions, entries freed because their coordinator's
index dropped them). A node with several models sums its
coordinators and its stages. Stage counts start again when the stage is reloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshd.coord.coordinator import Coordinator
from meshd.model.kvcache import KVCache

if TYPE_CHECKING:
    from meshd.api.metrics import ApiMetrics
    from meshd.node.node import MeshNode

log = logging.getLogger(__name__)


class PrefixCacheStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What the prefix cache did on this node (docs/architecture.md, "Prompt cache")."""

    # As coordinator: requests that looked, opened from an entry, prompt positions reused,
    # hits a stage could no longer serve (prefilled in full), prompt tokens looked up.
    lookups: int
    hits: int
    reused_tokens: int
    misses: int
    prompt_tokens: int
    # As stage host: entries and bytes held now, entries evicted for room (least recently
    # used first), entries freed because their coordinator's index dropped them
    # (`DropEntries`; not those freed with a lost node), opens served from an entry and
    # positions copied, opens that missed.
    entries: int
    bytes_held: int
    evictions: int
    dropped: int
    stage_hits: int
    stage_reused_tokens: int
    stage_misses: int


def prefix_cache_status(node: MeshNode) -> PrefixCacheStatus:
    """The node's prefix-cache counters now: every model's."""
    models = node.models
    return collect_status([m.coordinator for m in models], [m.slot.kv_cache for m in models])


def collect_status(
    coordinators: Iterable[Coordinator], caches: Iterable[KVCache | None]
) -> PrefixCacheStatus:
    """The sum of these coordinators' and stages' counters (None: a slot with no stage)."""
    counters = [c.prefix_counters for c in coordinators]
    kv = [cache for cache in caches if cache is not None]
    return PrefixCacheStatus(
        lookups=sum(c.lookups for c in counters),
        hits=sum(c.hits for c in counters),
        reused_tokens=sum(c.reused_tokens for c in counters),
        misses=sum(c.misses for c in counters),
        prompt_tokens=sum(c.prompt_tokens for c in counters),
        entries=sum(k.entries for k in kv),
        bytes_held=sum(k.cache_bytes for k in kv),
        evictions=sum(k.cache_stats.evictions for k in kv),
        dropped=sum(k.cache_stats.dropped for k in kv),
        stage_hits=sum(k.cache_stats.hits for k in kv),
        stage_reused_tokens=sum(k.cache_stats.reused_tokens for k in kv),
        stage_misses=sum(k.cache_stats.misses for k in kv),
    )


# /metrics: (name, help, field of PrefixCacheStatus). Counters get Prometheus's `_total`.
_COUNTERS = (
    ("meshd_prefix_cache_lookups", "Requests that looked up a cached prefix", "lookups"),
    ("meshd_prefix_cache_hits", "Requests whose prefill started from a cached prefix", "hits"),
    (
        "meshd_prefix_cache_reused_tokens",
        "Prompt tokens served from the stages' prefix cache instead of being prefilled",
        "reused_tokens",
    ),
    (
        "meshd_prefix_cache_misses",
        "Cached prefixes a stage no longer held (the request prefilled in full)",
        "misses",
    ),
    (
        "meshd_prefix_cache_evictions",
        "Prefix-cache entries this node's stage evicted for room",
        "evictions",
    ),
    (
        "meshd_prefix_cache_dropped",
        "Prefix-cache entries this node's stage freed because their coordinator no longer "
        "names them",
        "dropped",
    ),
)
_GAUGES = (
    (
        "meshd_prefix_cache_bytes",
        "Bytes of prefix-cache entries this node's stage holds",
        "bytes_held",
    ),
    ("meshd_prefix_cache_entries", "Prefix-cache entries this node's stage holds", "entries"),
)


class _PrefixCollector(Collector):
    """The families above, read at each scrape."""

    def __init__(self, read: Callable[[], PrefixCacheStatus]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        """The families without samples (so registering does not read yet)."""
        for name, documentation, _ in _COUNTERS:
            yield CounterMetricFamily(name, documentation)
        for name, documentation, _ in _GAUGES:
            yield GaugeMetricFamily(name, documentation)

    def collect(self) -> Iterator[Metric]:
        """The families with the counts as they are now."""
        try:
            status = self._read()
        except Exception:  # a broken reader must not take the metrics page down
            log.exception("prefix cache counters could not be read")
            return
        for name, documentation, field in _COUNTERS:
            yield CounterMetricFamily(name, documentation, value=getattr(status, field))
        for name, documentation, field in _GAUGES:
            yield GaugeMetricFamily(name, documentation, value=getattr(status, field))


def export_prefix_metrics(metrics: ApiMetrics, node: MeshNode) -> None:
    """Give /metrics the node's prefix-cache counters and gauges (read at each scrape)."""
    register_prefix_metrics(metrics, lambda: prefix_cache_status(node))


def register_prefix_metrics(metrics: ApiMetrics, read: Callable[[], PrefixCacheStatus]) -> None:
    """Export what `read()` returns at each scrape as the `meshd_prefix_cache_*` families."""
    metrics.registry.register(_PrefixCollector(read))
