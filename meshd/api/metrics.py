"""Prometheus metrics of one API app, in its own registry (so tests can build many apps).

The API feeds request, token, latency and speculation figures itself. The daemon adds the
mesh's figures: counters and histograms of events as they happen (`lane_died`,
`observe_stage_compute`), and a collector of its own on `registry` that reads every gauge and
running count from the node's state at each scrape (`meshd/node/node_metrics.py`), so a gauge
is never stale and nothing is pushed on every change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from meshd.speculative.telemetry import SpecTelemetry

log = logging.getLogger(__name__)

# Seconds; from sub-millisecond loopback passes to a slow WAN prefill.
_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_TOKENS_PER_TRIP_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ApiMetrics:
    """The metrics of one app; `render()` gives the exposition text for `/metrics`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "meshd_api_requests",
            "HTTP requests by route (a path of the API, or other) and status (499: the client "
            "went away)",
            ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "meshd_api_requests_in_flight", "HTTP requests being served", registry=r
        )
        self.request_duration = Histogram(
            "meshd_api_request_duration_seconds", "Time to serve a request, by route",
            ["route"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "meshd_api_prompt_tokens",
            "Prompt tokens of requests that reached the model",
            registry=r,
        )
        self.generated_tokens = Counter(
            "meshd_api_generated_tokens",
            "Tokens generated, counted as they commit (cancelled requests included)",
            registry=r,
        )
        self.ttft = Histogram(
            "meshd_api_time_to_first_token_seconds",
            "From the request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "meshd_api_time_per_output_token_seconds",
            "Time between generated tokens after the first (a window committing n tokens gives n "
            "samples of its interval / n)",
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.spec_drafted = Counter(
            "meshd_spec_drafted_tokens", "Draft tokens proposed, by proposer", ["proposer"],
            registry=r,
        )  # fmt: skip
        self.spec_accepted = Counter(
            "meshd_spec_accepted_tokens",
            "Draft tokens accepted, by proposer (acceptance = accepted / drafted)", ["proposer"],
            registry=r,
        )  # fmt: skip
        self.spec_draft_seconds = Counter(
            "meshd_spec_draft_seconds",
            "Coordinator time in its draft model (spec.draft_model; proposers draft, draft-ngram)",
            registry=r,
        )  # fmt: skip
        self.spec_acceptance = Histogram(
            "meshd_spec_acceptance_ratio", "Per request: accepted / drafted tokens",
            buckets=_RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.spec_tokens_per_trip = Histogram(
            "meshd_spec_tokens_per_round_trip", "Per request: tokens committed per verify trip",
            buckets=_TOKENS_PER_TRIP_BUCKETS, registry=r,
        )  # fmt: skip
        self.lane_deaths = Counter(
            "meshd_lane_deaths", "Lanes whose peer stopped answering, by peer (node id)",
            ["peer"], registry=r,
        )  # fmt: skip
        self.stage_compute = Histogram(
            "meshd_stage_compute_seconds",
            "Compute time of one forward pass (a batch of windows) of a local stage",
            ["model", "layers"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self._scrape_hooks: list[Callable[[], None]] = []
        self._requests = 0
        self._no_requests = trio.Event()
        self._no_requests.set()

    # -- fed by the API -----------------------------------------------------------------
    def request_done(self, route: str, status: int, duration_s: float) -> None:
        """One HTTP request finished."""
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_duration.labels(route=route).observe(duration_s)

    def speculation(self, telemetry: SpecTelemetry) -> None:
        """A generation's speculative decoding figures."""
        for name, counts in telemetry.proposers.items():
            self.spec_drafted.labels(proposer=name).inc(counts.drafted)
            self.spec_accepted.labels(proposer=name).inc(counts.accepted)
        if telemetry.draft_s > 0:
            self.spec_draft_seconds.inc(telemetry.draft_s)
        if telemetry.acceptance is not None:
            self.spec_acceptance.observe(telemetry.acceptance)
        if telemetry.tokens_per_round_trip is not None:
            self.spec_tokens_per_trip.observe(telemetry.tokens_per_round_trip)

    def request_started(self) -> None:
        """An HTTP request came in (the middleware's call)."""
        self.in_flight.inc()
        self._requests += 1
        if self._no_requests.is_set():
            self._no_requests = trio.Event()

    def request_ended(self) -> None:
        """An HTTP request's response is complete, or its client went away."""
        self.in_flight.dec()
        self._requests -= 1
        if self._requests == 0:
            self._no_requests.set()

    async def wait_no_requests(self) -> None:
        """Return once no HTTP request is in flight (a stopping daemon's last responses)."""
        await self._no_requests.wait()

    def totals(self) -> dict[str, float]:
        """Running totals for the console (it derives rates from two readings)."""

        def total(metric: Counter) -> float:
            return sum(
                s.value
                for family in metric.collect()
                for s in family.samples
                if not s.name.endswith("_created")
            )

        return {
            "prompt_tokens": total(self.prompt_tokens),
            "generated_tokens": total(self.generated_tokens),
            "spec_drafted_tokens": total(self.spec_drafted),
            "spec_accepted_tokens": total(self.spec_accepted),
        }

    # -- hooks for the daemon -----------------------------------------------------------
    def lane_died(self, peer: str) -> None:
        """The lane to `peer` (a node id) was declared dead: its peer stopped answering."""
        self.lane_deaths.labels(peer=peer).inc()

    def observe_stage_compute(self, model: str, layers: str, seconds: float) -> None:
        """A local stage of `model` serving `layers` (e.g. "0-4") ran one pass in `seconds`."""
        self.stage_compute.labels(model=model, layers=layers).observe(seconds)

    def count_by(
        self, name: str, documentation: str, label: str, read: Callable[[], Mapping[str, int]]
    ) -> None:
        """Export counts another part keeps (e.g. the endpoint's drops) as one counter.

        `read()` gives {label value: count} at each scrape; the counter is `name_total` with
        one sample per value, labelled `label` (e.g. `reason`, `cause`).
        """
        self.registry.register(_CountsCollector(name, documentation, label, read))

    def on_scrape(self, hook: Callable[[], None]) -> None:
        """Call `hook` before each scrape (to refresh gauges from live state)."""
        self._scrape_hooks.append(hook)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        for hook in self._scrape_hooks:
            try:
                hook()
            except Exception:  # a broken hook must not take the metrics page down
                log.exception("metrics scrape hook failed")
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _CountsCollector(Collector):
    """A counter whose values live elsewhere, read at each scrape."""

    def __init__(
        self, name: str, documentation: str, label: str, read: Callable[[], Mapping[str, int]]
    ) -> None:
        self._family = (name, documentation, label)
        self._read = read

    def describe(self) -> Iterator[CounterMetricFamily]:
        """The family without samples (so registering does not read yet)."""
        name, documentation, label = self._family
        yield CounterMetricFamily(name, documentation, labels=[label])

    def collect(self) -> Iterator[CounterMetricFamily]:
        """The family with the counts as they are now."""
        name, documentation, label = self._family
        family = CounterMetricFamily(name, documentation, labels=[label])
        try:
            counts = dict(self._read())
        except Exception:  # a broken reader must not take the metrics page down
            log.exception("metrics counter %s could not be read", name)
            counts = {}
        for value, count in counts.items():
            family.add_metric([value], count)
        yield family
