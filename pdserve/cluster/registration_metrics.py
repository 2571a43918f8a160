"""A worker's etcd registration as Prometheus metrics, on both roles' ``/metrics``.

`RegistrationCollector` reads the worker's `Registration` (registration.py) at scrape time (one
source of truth, no double bookkeeping), with the labels of the worker's other metrics:

- ``pdserve_etcd_registration{state}``: 1 for the state the registration is in, 0 for the others
  (`RegistrationState`: registered, recovering after a lost lease or while etcd is unreachable,
  conflict and denied where it gave up, ...). A worker that is not ``registered`` is missing
  from every other process's view of the cluster (gateways, decode workers' prefill pool).
- ``pdserve_etcd_reregistrations_total``: times the worker's record was written again under a
  new lease after its lease was lost (it expired while the worker was cut off or stalled).

decode/metrics.py and prefill/metrics.py register one each once the worker has joined
(``watch_registration``); the chart's alerts on lease loss read them (deploy/helm/pdserve).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cluster.registration import Registration, RegistrationState

__all__ = ["RegistrationCollector"]


class RegistrationCollector:
    """The registration's state and re-registrations, with ``labels``."""

    def __init__(self, registration: Registration, labels: Mapping[str, str]):
        self.registration = registration
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        state = GaugeMetricFamily("pdserve_etcd_registration",
                                  "1 for the state this worker's etcd registration is in (registered, recovering: "
                                  "lease lost or etcd unreachable, conflict, denied, ...), 0 for the others",
                                  labels=names + ["state"])
        for s in RegistrationState:
            state.add_metric(values + [s.value], 1.0 if self.registration.state is s else 0.0)
        yield state
        again = CounterMetricFamily("pdserve_etcd_reregistrations",
                                    "Times this worker's record was written again under a new lease after its "
                                    "lease was lost", labels=names)
        again.add_metric(values, float(self.registration.reregistrations))
        yield again
