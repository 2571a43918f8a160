"""Speculative decoding on a decode worker: its Prometheus metrics on ``/metrics``, and what the
router's snapshot reads of it (`spec_outlook`; docs/speculative.md).

The engine counts its verifications in `EngineStats` (engine/spec_decode.py `SpecDecoder.record`);
`SpecDecodeCollector` reads those counters at scrape time (one source of truth), under vLLM's
names with pdserve's prefix (vLLM: ``vllm:spec_decode_num_drafts`` ...; here
``pdserve_spec_decode_num_drafts_total`` ...), with the labels of the worker's other metrics.
A worker registers it only when its engine speculates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric

from pdserve.common.spec_rule import spec_k
from pdserve.engine.engine_types import EngineStats
from pdserve.engine.llm_engine import LLMEngine

__all__ = ["SpecDecodeCollector", "SPEC_METRICS", "spec_outlook"]

# name (without the _total suffix), help text, the `EngineStats` field
SPEC_METRICS: tuple[tuple[str, str, str], ...] = (
    ("pdserve_spec_decode_num_drafts", "Verifications of proposed tokens (one per request and step with proposals)",
     "num_spec_drafts"),
    ("pdserve_spec_decode_num_draft_tokens", "Tokens proposed for verification", "num_spec_draft_tokens"),
    ("pdserve_spec_decode_num_accepted_tokens", "Proposed tokens the verification accepted",
     "num_spec_accepted_tokens"),
    ("pdserve_spec_decode_cost_off_steps", "Decode steps the measured-cost rule kept from speculating "
     "(speculative_config.disable_by_cost)", "num_spec_cost_off_steps"),
    ("pdserve_spec_decode_draft_prompts_shipped", "Remote prompts whose draft-model KV the prefill worker computed "
     "and shipped beside the target's (speculative_config.draft_prompt_kv)", "num_spec_prompts_shipped"),
    ("pdserve_spec_decode_draft_prompts_local", "Remote prompts whose draft-model KV this worker's draft computed "
     "itself (draft_prompt_kv decode, auto with no other stream decoding, or a prefill worker without the draft)",
     "num_spec_prompts_local"),
)
PER_POSITION = "pdserve_spec_decode_num_accepted_tokens_per_pos"


class SpecDecodeCollector:
    """The engine's speculative decoding counters with ``labels``; ``stats`` returns the engine's
    `EngineStats` (read from the engine thread's counters: plain ints, a list copied here)."""

    def __init__(self, stats: Callable[[], EngineStats], labels: Mapping[str, str]):
        self.stats = stats
        self.labels = dict(labels)

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry checks names with it, calling no engine)."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.stats())

    def _families(self, stats: EngineStats | None) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, field in SPEC_METRICS:
            family = CounterMetricFamily(name, doc, labels=names)
            if stats is not None:
                family.add_metric(values, float(getattr(stats, field)))
            yield family
        per = CounterMetricFamily(PER_POSITION, "Proposed tokens accepted, by their position among a step's proposals "
                                  "(0: the first)", labels=names + ["position"])
        if stats is not None:
            for j, n in enumerate(list(stats.spec_accepted_per_position)):
                per.add_metric(values + [str(j)], float(n))
        yield per


def spec_outlook(engine: LLMEngine, streams: int) -> tuple[int | None, float]:
    """Speculative decoding as a stream admitted beside ``streams`` decoding ones would meet
    it (the router's snapshot, router/values.py): the proposals it would get per step
    (common/spec_rule.py, before its own acceptance counts), and the mean tokens a verifying
    step gave a stream so far (1 + accepted / verifications; 1.0 before any). (None, 1.0)
    without speculation. Reads plain attributes only: safe beside the engine thread."""
    spec = engine.spec
    if spec is None:
        return None, 1.0
    stats = engine.stats
    per_step = 1.0 + stats.num_spec_accepted_tokens / stats.num_spec_drafts if stats.num_spec_drafts else 1.0
    if spec.cost is not None and not spec.cost.pays(streams + 1):
        return 0, per_step  # the measured-cost rule keeps steps of that batch plain (engine/spec_cost.py)
    return spec_k(spec.cfg.num_speculative_tokens, spec.cfg.disable_by_batch_size, streams + 1), per_step
