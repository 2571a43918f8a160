"""The structured-output compiler's Prometheus metrics, on both roles' ``/metrics``.

Each worker's engine compiles the grammars of its structured-output requests and caches them
(engine/structured.py `GrammarCompiler`; `LLMEngine.grammar_stats`). `GrammarCollector` reads
those counters at scrape time (one source of truth, no double bookkeeping), with the labels of
the worker's other metrics: decode/metrics.py and prefill/metrics.py register one each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["GrammarCollector", "GRAMMAR_METRICS"]

# name (counters without their _total suffix), kind, help text, the `GrammarCompiler.stats` key
GRAMMAR_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("pdserve_grammar_compiles", "counter",
     "Grammars compiled for structured outputs (cache misses; failed compiles included)", "misses"),
    ("pdserve_grammar_cache_hits", "counter",
     "Structured-output grammars found compiled, or being compiled, in the cache", "hits"),
    ("pdserve_grammar_compile_errors", "counter",
     "Grammars that did not compile (the request got a 400 / INVALID_ARGUMENT naming its field)",
     "compile_errors"),
    ("pdserve_grammar_compile_timeouts", "counter",
     "Waits for a grammar that gave up at the engine's structured_outputs_timeout_s", "timeouts"),
    ("pdserve_grammar_compile_seconds", "counter", "Time spent compiling grammars, failed compiles included",
     "compile_seconds"),
    ("pdserve_grammar_cache_evictions", "counter",
     "Compiled grammars evicted from the cache (over its entries or bytes bound)", "evictions"),
    ("pdserve_grammar_cache_entries", "gauge", "Compiled grammars in the cache", "entries"),
    ("pdserve_grammar_cache_bytes", "gauge", "Memory the cached compiled grammars hold", "bytes"),
)


class GrammarCollector:
    """The compiler's counters and gauges with ``labels``; ``stats`` returns
    `GrammarCompiler.stats()` (or None while the worker has no engine: no samples)."""

    def __init__(self, stats: Callable[[], Mapping[str, float] | None], labels: Mapping[str, str]):
        self.stats = stats
        self.labels = dict(labels)

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry checks names with it, calling no engine)."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.stats())

    def _families(self, stats: Mapping[str, float] | None) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for name, kind, doc, key in GRAMMAR_METRICS:
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, doc, labels=names)
            else:
                family = GaugeMetricFamily(name, doc, labels=names)
            if stats is not None:
                family.add_metric(values, float(stats.get(key, 0)))
            yield family
