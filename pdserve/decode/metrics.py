"""Prometheus metrics a decode worker exports on `GET /metrics` (docs/api.md); the
routing and admission ones are described in docs/router.md.

Each worker owns its own `CollectorRegistry`, so several workers can live in
one process (tests) without clashing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from pdserve.cluster.grammar_metrics import GrammarCollector
from pdserve.cluster.registration import Registration
from pdserve.cluster.registration_metrics import RegistrationCollector
from pdserve.common.thread_cpu import ThreadCPUCollector
from pdserve.engine.engine_types import EngineStats
from pdserve.engine.step_budget import RULES

from .spec_metrics import SpecDecodeCollector

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                      1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                            0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))
# measured TTFT / predicted TTFT of the route taken: 1 is a perfect prediction; (0.833, 1.25]
# is "within 20 %" (|measured - predicted| < 20 % of measured)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.833, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class WorkerMetrics:
    """Counters, gauges and histograms of one worker, labelled by role."""

    def __init__(self, role: str, worker_id: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"role": role, "worker_id": worker_id}
        self.labels = labels
        self.thread_cpu = ThreadCPUCollector(labels)  # where the process's cores go, by thread (common/thread_cpu.py)
        r.register(self.thread_cpu)

        def hist(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        self.ttft = hist("pdserve_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS_S)
        self.tpot = hist("pdserve_time_per_output_token_seconds", "Mean time per output token after the first, per request", _TOKEN_LATENCY_BUCKETS_S)
        self.itl = hist("pdserve_inter_token_latency_seconds", "Gap between consecutive streamed tokens", _TOKEN_LATENCY_BUCKETS_S)
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS_S)
        self.queue_wait = hist("pdserve_request_queue_seconds", "Arrival to first scheduled step", _LATENCY_BUCKETS_S)
        self.held_for_kv = hist("pdserve_admission_held_for_kv_seconds",
                                "Arrival to admission of prompts held for KV room (qos.kv_full_wait_ms)",
                                _LATENCY_BUCKETS_S)
        self.running = gauge("pdserve_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("pdserve_num_requests_waiting", "Requests waiting to be scheduled")
        self.waiting_remote = gauge("pdserve_num_requests_waiting_remote_kv", "Requests waiting for remote KV")
        self.kv_usage = gauge("pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1)")
        self.prefill_queue_depth = gauge("pdserve_prefill_queue_depth", "Prefill queue depth seen by this worker")
        self.prefill_queue_tokens = gauge("pdserve_prefill_queue_tokens", "Prefill queue token backlog seen by this worker")
        self.prefill_pool_size = gauge("pdserve_prefill_pool_size", "Live prefill workers seen by this worker")
        self.engine_alive = gauge("pdserve_engine_alive", "1 while the engine loop runs, 0 once it died")
        self.local_prefill_budget = gauge("pdserve_local_prefill_budget_tokens",
                                          "Prompt tokens one engine step may take (engine/step_plan.py)")
        names = list(labels)
        self._ttft_prediction = Histogram(
            "pdserve_ttft_prediction_ratio",
            "Measured TTFT / the router's predicted TTFT for the route it took (1: exact; docs/router.md)",
            names + ["route"], buckets=_RATIO_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens received", names, registry=r).labels(**labels)
        self.prefix_hit_tokens = Counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache", names, registry=r).labels(**labels)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", names, registry=r).labels(**labels)
        self._requests = Counter("pdserve_requests", "Finished requests by finish reason", names + ["finish_reason"], registry=r)
        self._decisions = Counter("pdserve_router_decisions", "Router decisions by route and reason", names + ["route", "reason"], registry=r)
        self._refused = Counter("pdserve_admissions_refused", "Requests refused by QoS admission", names + ["reason"], registry=r)
        self._errors = Counter("pdserve_request_errors", "Requests failed with an error, by status", names + ["code"], registry=r)
        self.fallbacks = Counter("pdserve_remote_prefill_fallbacks", "Remote prefills that fell back to local", names + ["reason"], registry=r)
        self._steps = Histogram("pdserve_engine_step_seconds", "Engine steps as the router's cost model times them "
                                "(schedule, forward, sample), by kind: decode (no prompt tokens) or mixed",
                                names + ["kind"], buckets=_TOKEN_LATENCY_BUCKETS_S, registry=r)
        self.transfer_bytes = hist("pdserve_kv_transfer_bytes", "KV bytes received per remote prefill", _BYTES_BUCKETS)
        self.transfer_seconds = hist("pdserve_kv_transfer_seconds", "KV transfer duration per remote prefill", _LATENCY_BUCKETS_S)
        self.transfer_failures = Counter("pdserve_kv_transfer_failures", "Failed KV transfers", names, registry=r).labels(**labels)
        # Per LoRA adapter (docs/lora.md, "Metrics"): requests admitted, their prompt and generated tokens
        self._lora_requests = Counter("pdserve_lora_requests", "Requests admitted per LoRA adapter",
                                      names + ["lora_name"], registry=r)
        self._lora_prompt_tokens = Counter("pdserve_lora_prompt_tokens", "Prompt tokens received per LoRA adapter",
                                           names + ["lora_name"], registry=r)
        self._lora_generation_tokens = Counter("pdserve_lora_generation_tokens", "Tokens generated per LoRA adapter",
                                               names + ["lora_name"], registry=r)
        self._refused_notifications = Counter(
            "pdserve_remote_notifications_refused",
            "PrefillDone notices refused: no live attempt (request, epoch) here, or a token count other than the "
            "signed task's", names + ["reason"], registry=r)

    def watch_grammars(self, stats: Callable[[], Mapping[str, float] | None]) -> None:
        """Export the engine's structured-output compiler (`LLMEngine.grammar_stats`), read at
        each scrape: the ``pdserve_grammar_*`` metrics (cluster/grammar_metrics.py)."""
        self.registry.register(GrammarCollector(stats, self.labels))

    def watch_core_threads(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Also export the engine-core process's CPU by thread (decode/core_client.py), as
        ``pdserve_thread_cpu_seconds{thread="core/<group>"}``."""
        self.thread_cpu.add_process(lambda: {f"core/{group}": secs for group, secs in read().items()})

    def watch_spec_decode(self, stats: Callable[[], EngineStats]) -> None:
        """Export the engine's speculative decoding counters (`EngineStats`), read at each scrape:
        the ``pdserve_spec_decode_*`` metrics (decode/spec_metrics.py)."""
        self.registry.register(SpecDecodeCollector(stats, self.labels))

    def watch_step_plan(self, stats: Callable[[], EngineStats]) -> None:
        """Export the step plan's choices, read at each scrape: ``pdserve_step_plan_steps_total
        {rule}``, the engine steps with prompt tokens to place by the rule that sized them
        (engine/step_budget.py RULES; docs/router.md "The step plan")."""
        self.registry.register(_StepPlanCollector(stats, self.labels))

    def watch_registration(self, registration: Registration) -> None:
        """Export the worker's etcd registration, read at each scrape: its state and lease losses
        (cluster/registration_metrics.py)."""
        self.registry.register(RegistrationCollector(registration, self.labels))

    def ttft_prediction(self, route: str, ratio: float) -> None:
        self._ttft_prediction.labels(route=route, **self.labels).observe(ratio)

    def request_finished(self, reason: str) -> None:
        self._requests.labels(finish_reason=reason, **self.labels).inc()

    def step(self, seconds: float, prompt_tokens: int) -> None:
        self._steps.labels(kind="mixed" if prompt_tokens else "decode", **self.labels).observe(seconds)

    def decision(self, route: str, reason: str) -> None:
        self._decisions.labels(route=route, reason=reason, **self.labels).inc()

    def lora_admitted(self, lora_name: str, prompt_tokens: int) -> None:
        self._lora_requests.labels(lora_name=lora_name, **self.labels).inc()
        self._lora_prompt_tokens.labels(lora_name=lora_name, **self.labels).inc(prompt_tokens)

    def lora_generated(self, lora_name: str, tokens: int) -> None:
        self._lora_generation_tokens.labels(lora_name=lora_name, **self.labels).inc(tokens)

    def refused(self, reason: str) -> None:
        self._refused.labels(reason=reason, **self.labels).inc()

    def error(self, code: str) -> None:
        self._errors.labels(code=code, **self.labels).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(reason=reason, **self.labels).inc()

    def refused_notification(self, reason: str) -> None:
        self._refused_notifications.labels(reason=reason, **self.labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StepPlanCollector:
    """The engine's `EngineStats.step_plan_rules` as one counter family labelled by rule."""

    def __init__(self, stats: Callable[[], EngineStats], labels: Mapping[str, str]):
        self.stats = stats
        self.labels = dict(labels)

    def describe(self):
        return self._families(None)

    def collect(self):
        return self._families(self.stats())

    def _families(self, stats: EngineStats | None):
        family = CounterMetricFamily("pdserve_step_plan_steps", "Engine steps with prompt tokens to place, by the "
                                     "step plan's rule that sized them", labels=list(self.labels) + ["rule"])
        if stats is not None:
            counts = dict(stats.step_plan_rules)
            for rule in RULES:
                family.add_metric(list(self.labels.values()) + [rule], float(counts.get(rule, 0)))
        yield family
