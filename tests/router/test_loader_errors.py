"""Broken policy documents fail with the dotted key path and the file line."""

from __future__ import annotations

import pytest

from pdserve.router.loader import (
    PolicyError,
    detect_kind,
    load_policy_file,
    parse_any,
    parse_autoscale,
    parse_policy,
)


def error_of(text: str, parse=parse_policy, source: str = "p.yaml") -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse(text, source)
    return info.value


def test_unknown_key_names_path_line_and_suggestion():
    text = "router:\n  threshold:\n    prefil_queue_max: 5\n"
    err = error_of(text)
    assert "p.yaml:3:5: router.threshold.prefil_queue_max: unknown key" in str(err)
    assert "did you mean 'prefill_queue_max'" in str(err)


def test_unknown_top_level_key_lists_the_allowed_sections():
    err = error_of("routr:\n  mode: conditional\n")
    assert "p.yaml:1:1: routr: unknown key" in str(err)
    assert "allowed: router, qos" in str(err)


def test_bad_enum_value_names_key_line_and_value():
    err = error_of("router:\n  mode: conditional\n  policy: magic\n")
    assert err.issues[0].path == "router.policy"
    assert err.issues[0].line == 3
    assert "'magic'" in str(err)


def test_out_of_range_value_names_key_and_line():
    err = error_of("qos:\n  ttft_slo_ms: 500\n  tpot_slo_ms: -5\n")
    assert "p.yaml:3:3: qos.tpot_slo_ms: Input should be greater than 0 (got -5)" in str(err)


def test_quoted_number_is_not_an_integer():
    err = error_of('router:\n  threshold:\n    prefill_length_threshold: "256"\n')
    assert err.issues[0].path == "router.threshold.prefill_length_threshold"
    assert err.issues[0].line == 3


def test_error_inside_a_list_item_points_at_that_item():
    text = (
        "router:\n"
        "  disaggregated_router:\n"
        "    policies:\n"
        "      - {metric: prefill_length, threshold: 256, action: prefer_remote, weight: 0.7}\n"
        "      - {metric: queue, threshold: 10, action: prefer_local, weight: 0.3}\n"
    )
    err = error_of(text)
    assert err.issues[0].path == "router.disaggregated_router.policies[1].metric"
    assert err.issues[0].line == 5


def test_percentage_threshold_on_a_fraction_metric_is_refused():
    text = (
        "router:\n  disaggregated_router:\n    policies:\n"
        "      - {metric: decode_kv_usage, threshold: 80, action: prefer_remote, weight: 1}\n"
    )
    err = error_of(text)
    assert "fraction 0-1, not a percentage" in str(err)
    assert err.issues[0].line == 4


def test_negative_score_weight_is_refused():
    text = (
        "router:\n  disaggregated_router:\n    policies:\n"
        "      - {metric: prefill_length, threshold: 1, action: prefer_local, weight: -0.3}\n"
    )
    assert error_of(text).issues[0].path == "router.disaggregated_router.policies[0].weight"


def test_every_problem_is_reported_sorted_by_line():
    text = "router:\n  mode: sometimes\nqos:\n  bogus: 1\n  ttft_slo_ms: 0\n"
    err = error_of(text)
    assert [i.line for i in err.issues] == [2, 4, 5]


def test_duplicate_key_is_an_error_not_last_wins():
    err = error_of("router:\n  mode: always_local\n  mode: always_remote\n")
    assert "p.yaml:3:3: router.mode: duplicate key" in str(err)


def test_yaml_syntax_error_carries_its_line():
    err = error_of("router:\n  mode: conditional\n  policy: [score\n")
    assert "invalid YAML" in str(err)
    assert err.issues[0].line is not None and err.issues[0].line >= 3


def test_top_level_list_is_refused():
    assert "top level must be a mapping" in str(error_of("- router\n"))


def test_policy_error_is_a_value_error():
    assert issubclass(PolicyError, ValueError)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("router:\n  mode: nope\n")
    with pytest.raises(PolicyError, match=r"broken\.yaml:2:3: router\.mode"):
        load_policy_file(path)


def test_autoscale_fraction_for_a_percentage_is_refused():
    text = "autoscale:\n  decode:\n    scale_up: {queue_length: 16, kv_cache_usage: 0.75}\n"
    err = error_of(text, parse_autoscale)
    assert "kv_cache_usage is a percentage" in str(err)
    assert err.issues[0].line == 3


def test_autoscale_min_above_max_is_refused():
    err = error_of("autoscale:\n  prefill:\n    min_replicas: 5\n    max_replicas: 2\n", parse_autoscale)
    assert "p.yaml:2:3: autoscale.prefill: min_replicas (5) exceeds max_replicas (2)" in str(err)


def test_autoscale_scale_down_must_be_below_scale_up():
    text = "autoscale:\n  decode:\n    scale_down: {queue_length: 16, kv_cache_usage: 30}\n"
    assert "scale_down.queue_length (16) must be below scale_up.queue_length (16)" in str(
        error_of(text, parse_autoscale)
    )


def test_autoscale_minimum_replicas_must_fit_the_gpu_budget():
    text = "autoscale:\n  prefill: {min_replicas: 2, gpus_per_replica: 4}\n  gpu_budget: 8\n"
    assert "need 9 GPUs, more than gpu_budget (8)" in str(error_of(text, parse_autoscale))


def test_autoscale_unknown_key_is_refused():
    err = error_of("autoscale:\n  prefill:\n    max_replica: 3\n", parse_autoscale)
    assert "p.yaml:3:5: autoscale.prefill.max_replica: unknown key" in str(err)


def test_kind_is_detected_from_the_top_level_key():
    assert detect_kind("autoscale:\n  max_step: 2\n") == "autoscale"
    assert detect_kind("router:\n  mode: always_local\n") == "router"


def test_router_and_autoscale_in_one_file_is_refused():
    err = error_of("autoscale: {}\nrouter: {}\n", parse_any)
    assert "router: unknown key" in str(err)


def test_unknown_key_inside_a_list_item_lists_that_items_keys():
    text = (
        "router:\n  disaggregated_router:\n    policies:\n"
        "      - metric: prefill_length\n        threshold: 256\n        action: prefer_remote\n"
        "        weight: 0.7\n        wieght: 0.7\n"
    )
    err = error_of(text)
    assert "p.yaml:8:9: router.disaggregated_router.policies[0].wieght: unknown key" in str(err)
    assert "allowed: metric, threshold, action, weight" in str(err)


def test_missing_required_key_points_at_the_item_lacking_it():
    text = (
        "router:\n  disaggregated_router:\n    policies:\n"
        "      - {metric: prefill_length, threshold: 256, action: prefer_remote}\n"
    )
    err = error_of(text)
    assert "p.yaml:4:9: router.disaggregated_router.policies[0].weight: Field required" in str(err)


def test_worker_selection_is_refused_as_not_used_yet():
    text = "router:\n  mode: conditional\n  worker_selection:\n    prefill:\n      strategy: round_robin\n"
    err = error_of(text)
    assert len(err.issues) == 1
    issue = err.issues[0]
    assert (issue.path, issue.line) == ("router.worker_selection", 3)
    message = str(err)
    assert message.startswith("p.yaml:3:3: router.worker_selection: not used yet: ")
    assert "pull tasks from one shared queue" in message  # why
    assert "delete the worker_selection block" in message  # what to do
    assert "unknown key" not in message


def test_worker_selection_is_refused_even_when_empty_or_beside_other_errors():
    assert "not used yet" in str(error_of("router:\n  worker_selection:\n"))
    err = error_of("router:\n  worker_selection: {}\nqos:\n  tpot_slo_ms: -1\n")
    assert [i.path for i in err.issues] == ["router.worker_selection", "qos.tpot_slo_ms"]


def test_worker_selection_elsewhere_is_an_ordinary_unknown_key():
    err = error_of("qos:\n  worker_selection: {}\n")
    assert "qos.worker_selection: unknown key" in str(err)
