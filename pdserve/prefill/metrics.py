"""Prometheus metrics of a prefill worker, on its own `/metrics` endpoint.

Counters are read from the worker's `PrefillStats` at scrape time (one source of
truth, no double bookkeeping); batch shapes are histograms observed per batch.
Each worker owns its `CollectorRegistry`, so several can share a process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdserve.cluster.grammar_metrics import GrammarCollector
from pdserve.cluster.registration import Registration
from pdserve.cluster.registration_metrics import RegistrationCollector
from pdserve.cluster.runtime import MetricsEndpoint
from pdserve.common.thread_cpu import ThreadCPUCollector

_TASK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class _StatsCollector:
    """Exposes the worker's counters (tasks done/failed by kind, rejected by reason, transfer
    failures, bytes)."""

    def __init__(self, worker_id: str, stats):
        self.worker_id = worker_id
        self.stats = stats

    def collect(self):
        s, labels = self.stats, ["worker_id"]
        w = [self.worker_id]

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(w, value)
            return c

        yield counter("pdserve_prefill_tasks_done", "Prefill tasks whose pages were written", s.tasks_done)
        failed = CounterMetricFamily("pdserve_prefill_tasks_failed", "Prefill tasks that failed, by kind",
                                     labels=labels + ["kind"])
        for kind, n in sorted(s.failed_by_kind.items()):
            failed.add_metric(w + [kind], n)
        yield failed
        rejected = CounterMetricFamily("pdserve_prefill_tasks_rejected",
                                       "Tasks refused before any work: not signed by the decode worker they "
                                       "target, by reason", labels=labels + ["reason"])
        for reason, n in sorted(s.rejected_by_reason.items()):
            rejected.add_metric(w + [reason], n)
        yield rejected
        yield counter("pdserve_kv_transfer_failures", "KV page writes that failed or timed out", s.transfer_failures)
        yield counter("pdserve_kv_transfer_bytes_written", "KV bytes written to decode workers", s.bytes_written)
        yield counter("pdserve_prefill_batches", "Prefill batches run", s.batches)
        yield counter("pdserve_prefill_batches_failed", "Prefill batches whose forward pass raised", s.batches_failed)
        yield counter("pdserve_prefill_tokens_computed", "Prompt tokens prefilled and delivered", s.tokens_computed)
        yield counter("pdserve_prefill_failure_notices", "PrefillFailed notices sent over NIXL",
                      s.failure_notices_sent)


class PrefillMetrics:
    """The registry, the collectors and (once `serve` is called) the HTTP endpoint."""

    def __init__(self, worker_id: str, stats):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(worker_id, stats))
        labels = {"worker_id": worker_id}
        self.registry.register(ThreadCPUCollector(labels))  # by thread: the compute thread's, the loop's

        def hist(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

        self.batch_tasks = hist("pdserve_prefill_batch_tasks", "Tasks per prefill batch", _TASK_BUCKETS)
        self.batch_tokens = hist("pdserve_prefill_batch_tokens", "Prompt tokens computed per batch", _TOKEN_BUCKETS)
        self.batch_seconds = hist("pdserve_prefill_batch_seconds", "Prefill compute time per batch", _SECONDS_BUCKETS)
        self._labels = labels
        self._endpoint: MetricsEndpoint | None = None

    def watch_grammars(self, stats: Callable[[], Mapping[str, float] | None]) -> None:
        """Export the engine's structured-output compiler (`LLMEngine.grammar_stats`: the first
        token of a structured-output request is sampled here, under its grammar), read at each
        scrape: the ``pdserve_grammar_*`` metrics (cluster/grammar_metrics.py)."""
        self.registry.register(GrammarCollector(stats, self._labels))

    def watch_registration(self, registration: Registration) -> None:
        """Export the worker's etcd registration, read at each scrape: its state and lease losses
        (cluster/registration_metrics.py)."""
        self.registry.register(RegistrationCollector(registration, {**self._labels, "role": "prefill"}))

    def observe_batch(self, result) -> None:
        self.batch_tasks.observe(result.num_tasks)
        if result.batch_tokens:
            self.batch_tokens.observe(result.batch_tokens)
            self.batch_seconds.observe(result.prefill_ms / 1e3)

    def serve(self, host: str, port: int | None) -> str | None:
        """Start `/metrics` (port None: a free one; 0: off); returns "host:port" or None."""
        if port == 0:
            return None
        self._endpoint = MetricsEndpoint(self.registry, host, port)
        return self._endpoint.address

    @property
    def address(self) -> str | None:
        return self._endpoint.address if self._endpoint else None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
