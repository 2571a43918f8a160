"""The policy schema: the documented defaults, the shipped configs, strictness."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from pdserve.router.autoscale import AutoscalePolicy
from pdserve.router.loader import load_any_file, load_policy_file, parse_policy
from pdserve.router.policy import DEFAULT_POLICY, RouterPolicy, ScoreRule

REPO = Path(__file__).resolve().parents[2]
ROUTER_CONFIGS = sorted((REPO / "configs" / "router").glob("*.yaml"))
AUTOSCALE_CONFIGS = sorted((REPO / "configs" / "autoscale").glob("*.yaml"))


def test_threshold_defaults_are_the_documented_values():
    t = DEFAULT_POLICY.router.threshold
    assert (t.prefill_length_threshold, t.prefill_queue_max, t.decode_load_threshold, t.busy_min_length) == (
        256, 10, 8, 64,
    )


def test_score_defaults_are_the_documented_rules():
    s = DEFAULT_POLICY.router.disaggregated_router
    assert s.enable is True
    assert s.remote_prefill_min_score == 0.5
    assert s.policies == [
        ScoreRule(metric="prefill_length", threshold=256, action="prefer_remote", weight=0.7),
        ScoreRule(metric="prefill_queue_depth", threshold=10, action="prefer_local", weight=0.3),
    ]


def test_every_schema_key_is_read_outside_the_schema():
    """No dead settings: each field of the router/QoS models is read by router code (or, for
    the hold before a kv_pool_full refusal, by the decode worker's admission)."""
    readers = "".join((REPO / "router" / f).read_text() for f in ("decide.py", "rules.py", "qos.py", "costs.py"))
    readers += (REPO / "decode" / "frontend.py").read_text()
    unread = []
    pending = [type(DEFAULT_POLICY)]
    while pending:
        model = pending.pop()
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                pending.append(sub)
                continue
            pending += [a for a in get_args(sub) if isinstance(a, type) and issubclass(a, BaseModel)]
            if not re.search(rf"\.{name}\b", readers):
                unread.append(f"{model.__name__}.{name}")
    assert unread == []


def test_qos_defaults_admit_what_can_be_served():
    """Issue 28: the defaults refuse only a long predicted queue wait or a full KV pool; strict
    per-request SLO refusal is opt-in (docs/router.md, "How the defaults were chosen")."""
    q = DEFAULT_POLICY.qos
    assert (q.ttft_slo_ms, q.tpot_slo_ms, q.low_priority_threshold_ms, q.max_queue_wait_ms) == (1000, 50, 1000, 2000)
    assert q.enable_early_rejection and q.reject_when_kv_full and not q.reject_on_slo_violation
    assert q.kv_full_wait_ms == 1000  # a prompt waits up to the TTFT target for KV room before that refusal
    assert q.degrade.low_priority_max_tokens == 200
    assert q.degrade.no_remote_prefill_for_low_priority_when_busy is True


def test_default_mode_is_conditional_cost_model():
    assert (DEFAULT_POLICY.router.mode, DEFAULT_POLICY.router.policy) == ("conditional", "cost_model")


def test_five_router_configs_are_shipped():
    names = {p.name for p in ROUTER_CONFIGS}
    assert {"default.yaml", "threshold.yaml", "score.yaml", "always-remote.yaml", "always-local.yaml"} <= names


@pytest.mark.parametrize("path", ROUTER_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_router_config_validates(path):
    assert isinstance(load_policy_file(path), RouterPolicy)


@pytest.mark.parametrize("path", AUTOSCALE_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_autoscale_config_validates(path):
    assert isinstance(load_any_file(path), AutoscalePolicy)


def test_default_yaml_spells_out_exactly_the_schema_defaults():
    assert load_policy_file(REPO / "configs/router/default.yaml") == DEFAULT_POLICY


def test_autoscale_default_yaml_spells_out_the_schema_defaults():
    assert load_any_file(REPO / "configs/autoscale/default.yaml") == AutoscalePolicy()


def test_shipped_configs_select_their_named_behaviour():
    modes = {
        p.name: (load_policy_file(p).router.mode, load_policy_file(p).router.policy) for p in ROUTER_CONFIGS
    }
    assert modes["threshold.yaml"] == ("conditional", "threshold")
    assert modes["score.yaml"] == ("conditional", "score")
    assert modes["always-remote.yaml"][0] == "always_remote"
    assert modes["always-local.yaml"][0] == "always_local"


def test_score_yaml_holds_the_default_rules():
    policy = load_policy_file(REPO / "configs/router/score.yaml")
    assert policy.router.disaggregated_router == DEFAULT_POLICY.router.disaggregated_router


def test_empty_document_is_the_default_policy():
    assert parse_policy("# only a comment\n") == DEFAULT_POLICY


def test_section_with_only_comments_means_defaults():
    assert parse_policy("qos:\n  # nothing set yet\nrouter:\n") == DEFAULT_POLICY


def test_unset_keys_keep_their_defaults_next_to_set_ones():
    policy = parse_policy("router:\n  threshold:\n    prefill_queue_max: 3\n")
    assert policy.router.threshold.prefill_queue_max == 3
    assert policy.router.threshold.prefill_length_threshold == 256


def test_policy_is_immutable():
    with pytest.raises(Exception):
        DEFAULT_POLICY.router.threshold.prefill_queue_max = 1  # type: ignore[misc]
