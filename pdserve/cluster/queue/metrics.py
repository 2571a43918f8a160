"""Prometheus metrics of the prefill queue actor, on its own `/metrics` endpoint.

Depth, token backlog, oldest wait, in-flight tasks and the core's counters are
read from `QueueCore.stats()` at scrape time; the queue wait of each dispatched
task and the size of each batch handed out are histograms.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.cluster.runtime import MetricsEndpoint

_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_TASKS = (1, 2, 4, 8, 16, 32, 64, 128)
_BATCH_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _QueueCollector:
    def __init__(self, queue: Any) -> None:
        self.queue = queue  # the PrefillQueue actor (its core may not exist yet at registration)

    def collect(self) -> Iterator[Any]:  # prometheus_client's metric families
        core = getattr(self.queue, "_core", None)
        if core is None:
            return
        st = core.stats()
        for name, doc, value in (
            ("pdserve_queue_depth", "Tasks queued", st.depth),
            ("pdserve_queue_tokens", "Uncached prompt tokens queued", st.queued_tokens),
            ("pdserve_queue_oldest_wait_seconds", "Wait of the oldest queued task", st.oldest_wait_ms / 1e3),
            ("pdserve_queue_in_flight", "Tasks taken by prefill workers and not completed", sum(st.in_flight.values())),
            ("pdserve_queue_in_flight_tokens", "Prompt tokens of the tasks in flight", st.in_flight_tokens),
            ("pdserve_queue_failed_pending", "Failed tasks not yet taken by their origin", st.failed_pending),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        events = CounterMetricFamily("pdserve_queue_events", "Queue events by kind (put, dispatched, "
                                     "completed, requeued, failed_<reason>, rejected_<reason>, ...)",
                                     labels=["event"])
        for event, n in sorted(st.counters.items()):
            events.add_metric([event], n)
        yield events


class QueueMetrics:
    """The queue actor's registry and, once `serve` is called, its endpoint."""

    def __init__(self, queue: Any) -> None:  # the PrefillQueue actor
        self.registry = CollectorRegistry()
        self.registry.register(_QueueCollector(queue))
        self.wait = Histogram("pdserve_queue_wait_seconds", "Put to dispatch, per task", buckets=_WAIT_BUCKETS_S,
                              registry=self.registry)
        self.batch_tasks = Histogram("pdserve_queue_batch_tasks", "Tasks per batch handed out",
                                     buckets=_BATCH_TASKS, registry=self.registry)
        self.batch_tokens = Histogram("pdserve_queue_batch_tokens", "Uncached prompt tokens per batch handed out",
                                      buckets=_BATCH_TOKENS, registry=self.registry)
        self._endpoint: MetricsEndpoint | None = None

    def batch(self, tasks: list) -> None:
        if tasks:
            self.batch_tasks.observe(len(tasks))
            self.batch_tokens.observe(sum(t.num_prefill_tokens for t in tasks))

    def serve(self, host: str, port: int | None) -> str | None:
        if port == 0:
            return None
        self._endpoint = MetricsEndpoint(self.registry, host, port)
        return self._endpoint.address
