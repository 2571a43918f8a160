"""Prometheus metrics of one gateway: what it routed where and why, the streams it moved off a
failed decode worker, and the latencies its clients saw (docs/gateway.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                      1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self, gateway_id: str):
        self.registry = r = CollectorRegistry()
        self.labels = {"gateway_id": gateway_id}
        names = list(self.labels)
        self.ttft = Histogram("pdserve_gateway_time_to_first_token_seconds", "Time to first token through the gateway",
                              names, buckets=_LATENCY_BUCKETS_S, registry=r).labels(**self.labels)
        self._routed = Counter("pdserve_gateway_routed", "Sequences sent to each decode worker (first attempts)",
                               names + ["worker_id"], registry=r)
        self._migrations = Counter("pdserve_gateway_migrations",
                                   "Streams moved to another decode worker after theirs failed, by outcome",
                                   names + ["outcome"], registry=r)
        self._retries = Counter("pdserve_gateway_retries",
                                "Requests a decode worker refused before any token, sent to another one",
                                names + ["code"], registry=r)
        self._request_errors = Counter(
            "pdserve_gateway_request_errors",
            "Failed streams of decode workers, by how the gateway took them (gateway/frontend.py). scope: request "
            "(the worker marked the failure as the request's own: returned to the client, the worker kept in "
            "rotation), unmarked (INTERNAL / UNKNOWN without that mark: tried on one more worker, no worker "
            "avoided), worker (the worker died, dropped the stream or is draining: continued on another worker, "
            "that one avoided for a while). action: returned (to the client) or retried (on another worker)",
            names + ["scope", "action"], registry=r)
        self._requests = Counter("pdserve_gateway_requests", "Finished sequences by finish reason",
                                 names + ["finish_reason"], registry=r)
        self._errors = Counter("pdserve_gateway_errors", "Requests that ended with an error, by status code",
                               names + ["code"], registry=r)
        self._refused = Counter("pdserve_gateway_refused", "Requests refused by the gateway itself",
                                names + ["reason"], registry=r)
        self._races = Counter("pdserve_gateway_races",
                              "Racing decisions and outcomes: won_first / won_second (the predicted best or the "
                              "runner-up streamed first), both_failed, refused_load, refused_budget",
                              names + ["outcome"], registry=r)
        self.race_wasted_tokens = Counter("pdserve_gateway_race_wasted_prompt_tokens",
                                          "Prompt tokens the losers of races were sent (an upper bound of the "
                                          "work racing cost)", names, registry=r).labels(**self.labels)
        self.workers = Gauge("pdserve_gateway_decode_workers", "Decode workers the gateway can route to",
                             names, registry=r).labels(**self.labels)
        self.streams = Gauge("pdserve_gateway_streams", "Streams open through the gateway",
                             names, registry=r).labels(**self.labels)

    def routed(self, worker_id: str) -> None:
        self._routed.labels(worker_id=worker_id, **self.labels).inc()

    def migration(self, outcome: str) -> None:
        self._migrations.labels(outcome=outcome, **self.labels).inc()

    def retry(self, code: str) -> None:
        self._retries.labels(code=code, **self.labels).inc()

    def request_error(self, scope: str, action: str) -> None:
        self._request_errors.labels(scope=scope, action=action, **self.labels).inc()

    def race(self, outcome: str) -> None:
        self._races.labels(outcome=outcome, **self.labels).inc()

    def race_waste(self, tokens: int) -> None:
        self.race_wasted_tokens.inc(tokens)

    def request_finished(self, reason: str) -> None:
        self._requests.labels(finish_reason=reason, **self.labels).inc()

    def error(self, code: str) -> None:
        self._errors.labels(code=code, **self.labels).inc()

    def refused(self, reason: str) -> None:
        self._refused.labels(reason=reason, **self.labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
