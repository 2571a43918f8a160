"""Speculative decoding's measured-cost rule (engine/spec_cost.py, ``disable_by_cost``): the
decision from the figures, the probes of the side not taken, the engine's wiring (pure decode
steps feed it; a step it keeps plain proposes nothing; the router snapshot reads it), and the
config's defaults. No assertion here is on wall-clock time: the engine-level tests set the
figures the rule decides from."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.spec_config import parse_speculative_config
from pdserve.engine.spec_cost import PROBE_EVERY, CostBucket, SpecCostRule, bucket_of

from .test_spec_decode import prompts, run


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (0, 1, 2, 3, 4, 7, 8, 15, 16, 64)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 7]


def test_it_speculates_first_measures_a_plain_step_then_follows_the_figures():
    rule = SpecCostRule()
    assert rule.decide(8)  # nothing measured: speculate
    rule.observe(8, True, 10.0, 8 * 3)  # 3 tokens per request in 10 ms
    assert not rule.decide(8)  # one plain step to measure it
    rule.observe(8, False, 4.0, 8)  # 1 token in 4 ms: 3 x 4 = 12 > 10, speculation pays
    assert rule.decide(9) and rule.pays(12)
    assert rule.pays(1) and rule.decide(1)  # another bucket: its own figures (none yet)
    for _ in range(8):  # speculating steps turn slow: 3 tokens in 20 ms
        rule.observe(8, True, 20.0, 24)
    assert not rule.pays(8) and not rule.decide(8)
    assert rule.off_steps >= 2
    row = next(r for r in rule.explain() if r["batch"] == "8-15")
    assert row["speculates"] is False and row["tokens_per_request"] == pytest.approx(3.0)
    assert row["spec_ms"] > 3.0 * row["plain_ms"]


def test_probes_of_the_side_not_taken_back_off_while_nothing_changes():
    rule = SpecCostRule()
    rule.observe(4, True, 30.0, 8)  # 2 tokens per request in 30 ms
    rule.observe(4, False, 5.0, 4)  # 1 in 5 ms: plain steps win
    decisions = [rule.decide(4) for _ in range(8 * PROBE_EVERY)]
    probes = [i + 1 for i, on in enumerate(decisions) if on]  # (step counts)
    # decided at the first step; probed 32 steps later, then 64 and 128 steps after that
    assert probes == [1 + PROBE_EVERY, 1 + 3 * PROBE_EVERY, 1 + 7 * PROBE_EVERY]
    assert rule.off_steps == 8 * PROBE_EVERY - 3
    for _ in range(8):  # speculating steps get fast: the decision flips, probes start again at 32
        rule.observe(4, True, 6.0, 8)
    first = rule.buckets[bucket_of(4)].steps
    decisions = [rule.decide(4) for _ in range(PROBE_EVERY + 1)]
    assert decisions[0] and [i + 1 for i, on in enumerate(decisions) if not on] == [PROBE_EVERY + 1]
    assert rule.buckets[bucket_of(4)].steps == first + PROBE_EVERY + 1


def test_the_config_turns_it_on_where_proposing_costs_a_forward(llama_dir):
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).disable_by_cost is False
    cfg = parse_speculative_config({"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2})
    assert cfg.disable_by_cost is True
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "disable_by_cost": True}).disable_by_cost is True
    with pytest.raises(ConfigError, match="speculative_config.disable_by_cost"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_cost": "yes"})


def test_the_engine_feeds_it_and_a_step_it_keeps_plain_proposes_nothing(llama_dir):
    """Pure decode steps are timed into the rule (speculating and plain ones both appear once it
    has probed); with figures that say speculation does not pay at the batch, only the probes
    propose, and the output is the same."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
             "disable_by_cost": True}
    ps = prompts(4, seed=21)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, seed=0) as plain:
        want = run(plain, ps, params)
    with LLM(llama_dir, seed=0, speculative_config=ngram) as llm:
        rule = llm.engine.spec.cost
        assert rule is not None
        assert run(llm, ps, params) == want
        measured = [b for b in rule.buckets.values() if b.spec_ms is not None]
        assert measured and all(b.spec_ms > 0 and b.tokens_per_request >= 1.0 for b in measured)
        assert any(b.plain_ms is not None for b in measured)  # the one plain step after the first figure
        # Now figures that say a plain step wins at every batch size this run can meet.
        for key in range(1, 8):
            rule.buckets[key] = CostBucket(spec_ms=1e6, plain_ms=1.0, tokens_per_request=2.0, steps=1)
        rule.observe = lambda *a: None  # (keep those figures: this test is about the decision's effect)
        stats = llm.engine.stats
        before, off_before = stats.num_spec_drafts, rule.off_steps
        assert run(llm, ps, params) == want
        steps = rule.off_steps - off_before
        assert steps > 20  # the decode steps were kept plain...
        assert stats.num_spec_cost_off_steps == rule.off_steps  # (what /metrics exports)
        assert stats.num_spec_drafts - before <= len(ps) * (steps // PROBE_EVERY + 2)  # ...but for the probes


def test_the_router_snapshot_reads_the_decision(llama_dir):
    from pdserve.decode.spec_metrics import spec_outlook

    cfg = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_cost": True}
    with LLM(llama_dir, seed=0, speculative_config=cfg) as llm:
        eng = llm.engine
        assert spec_outlook(eng, 0)[0] == 3  # nothing measured: it would speculate
        eng.spec.cost.observe(1, True, 50.0, 2)
        eng.spec.cost.observe(1, False, 5.0, 1)
        assert spec_outlook(eng, 0)[0] == 0  # 2 tokens in 50 ms against 1 in 5: plain
        assert spec_outlook(eng, 3)[0] == 3  # batch 4: its own bucket, nothing measured
