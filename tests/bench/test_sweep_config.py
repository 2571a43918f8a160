"""What a sweep derives per mode: topology (same model and engine, N workers), policy, admission."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.bench.sweep import SweepConfig, derive_topology, mode_policy
from pdserve.cluster.topology import load_topology
from pdserve.router import parse_policy

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs" / "topologies" / "1p1d-local.yaml"
LENGTH_SPLIT = REPO / "bench" / "policies" / "length-split.yaml"


def config(tmp_path, **kw) -> SweepConfig:
    kw.setdefault("extra_policies", {"conditional-length-split": str(LENGTH_SPLIT)})
    return SweepConfig(output_dir=str(tmp_path), request_rates=[1.0, 2.0], topology=str(BASE),
                       modes=["colocated", "always-remote", "conditional", "conditional-length-split"], **kw)


@pytest.mark.parametrize("mode, prefill, decode, router_mode", [
    ("colocated", 0, 4, "always_local"),
    ("always-remote", 1, 3, "always_remote"),
    ("conditional", 1, 3, "conditional"),
    ("conditional-length-split", 1, 3, "conditional"),
])
def test_every_mode_has_the_same_workers_model_and_engine(tmp_path, mode, prefill, decode, router_mode):
    cfg = config(tmp_path, num_workers=4, prefill_workers=1)
    path = derive_topology(cfg, mode, "/models/m", tmp_path)
    topo = load_topology(path)  # validates, and the policy file exists
    base = load_topology(BASE)
    assert (topo.roles.prefill.replicas, topo.roles.decode.replicas) == (prefill, decode)
    assert topo.roles.decode.engine == base.roles.decode.engine
    assert topo.roles.prefill.engine == base.roles.prefill.engine
    assert topo.model.path == "/models/m" and topo.autoscale_policy is None
    assert set(topo.roles.decode.ports.values()) == {0}, "free ports: no clash with a running `pdserve up`"
    assert topo.cluster == f"local-bench-{mode}" and topo.queue.name == f"local-bench-{mode}-queue"
    policy = parse_policy(topo.router_policy_path.read_text())
    assert policy.router.mode == router_mode


def test_admission_slo_aligns_the_policies_qos_with_the_goodput_slos(tmp_path):
    cfg = config(tmp_path, slos={"ttft": 1500.0, "tpot": 40.0})
    for mode in cfg.modes:
        qos = mode_policy(cfg, mode)["qos"]
        assert qos["ttft_slo_ms"] == qos["max_queue_wait_ms"] == 1500.0 and qos["tpot_slo_ms"] == 40.0
    assert mode_policy(cfg, "conditional-length-split")["router"]["policy"] == "threshold"
    assert mode_policy(cfg, "conditional")["router"]["policy"] == "cost_model"  # configs/router/default.yaml


def test_admission_off_and_policy(tmp_path):
    off = mode_policy(config(tmp_path, admission="off", slos={"ttft": 1500.0, "tpot": 40.0}), "conditional")["qos"]
    # Nothing is refused, but the routers still see the benchmark's SLOs.
    assert off["enable_early_rejection"] is False and off["ttft_slo_ms"] == 1500.0 and off["tpot_slo_ms"] == 40.0
    kept = mode_policy(config(tmp_path, admission="policy"), "conditional")["qos"]
    assert kept == yaml.safe_load((REPO / "configs" / "router" / "default.yaml").read_text())["qos"]


@pytest.mark.parametrize("kw, message", [
    ({"modes": ["colocated", "disaggregated"]}, "--modes"),
    ({"request_rates": [1.0, 1.0]}, "each rate once"),
    ({"num_workers": 3, "prefill_workers": 3}, "--prefill-workers"),
    ({"admission": "maybe"}, "--admission"),
])
def test_bad_sweep_configs_are_refused(tmp_path, kw, message):
    base = dict(output_dir=str(tmp_path), request_rates=[1.0, 2.0])
    with pytest.raises(ValueError, match=message):
        SweepConfig(**{**base, **kw}).check()


def test_repeats_keep_the_median_run_and_the_spread():
    from pdserve.bench.sweep import median_run

    runs = [{"repeat": i, "request_goodput": g, "slo_attainment": a, "median_ttft_ms": t, "p99_ttft_ms": 2 * t,
             "median_itl_ms": 40.0, "p99_itl_ms": 90.0 + i, "mean_tpot_ms": 45.0}
            for i, (g, a, t) in enumerate([(1.2, 0.9, 300.0), (0.8, 0.7, 500.0), (1.0, 0.8, 400.0)])]
    mid = median_run(runs)
    assert mid["repeat"] == 2 and mid["request_goodput"] == 1.0  # the middle goodput, whole run kept
    assert mid["spread"]["request_goodput"] == [0.8, 1.2] and mid["spread"]["p99_itl_ms"] == [90.0, 92.0]
    assert [r["repeat"] for r in mid["repeats"]] == [0, 1, 2]
    assert median_run(runs[:1]) is runs[0]
    with pytest.raises(ValueError, match="--repeats 0"):
        SweepConfig(output_dir="x", request_rates=[1.0], repeats=0).check()
