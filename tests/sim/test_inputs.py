"""The simulator's inputs: cost profiles (files, the roofline, the fit), traces, the CLI."""

from __future__ import annotations

import json
import random
import re

import pytest

from pdserve.sim.measure import fit_error, fit_step_model
from pdserve.sim.profile import GPUS, MODELS, ProfileError, StepModel, load_profile, profile_from_dict, roofline
from pdserve.sim.workload import (
    SimRequest,
    WorkloadError,
    WorkloadSpec,
    generate,
    load_trace,
    mix,
    save_trace,
)


def test_roofline_from_published_numbers():
    prof = roofline(MODELS["llama-3-70b"], GPUS["h100"])
    assert prof.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert 1 not in prof.steps  # 141 GB of weights do not fit one 80 GB GPU
    t2, t8 = prof.steps[2], prof.steps[8]
    assert t8.fixed_ms < t2.fixed_ms and t8.prefill_ms_per_token < t2.prefill_ms_per_token
    assert t8.kv_blocks > t2.kv_blocks > 0
    assert any("H100" in a for a in prof.assumptions) and any("MFU" in a or "FLOP" in a for a in prof.assumptions)


def test_profiles_round_trip_and_bad_fields_are_named(tmp_path):
    prof = roofline(MODELS["llama-3-8b"], GPUS["h200"], (1, 2))
    for name in ("p.yaml", "p.json"):
        prof.save(tmp_path / name)
        assert load_profile(tmp_path / name) == prof
    body = prof.to_dict()
    with pytest.raises(ProfileError, match="transfer_gb_per_s must be > 0"):
        profile_from_dict({**body, "transfer_gb_per_s": 0})
    with pytest.raises(ProfileError, match="unknown field 'bandwidth'"):
        profile_from_dict({**body, "bandwidth": 1})
    with pytest.raises(ProfileError, match=r"steps\.1\.fixed_ms must be a number >= 0"):
        profile_from_dict({**body, "steps": {1: {**body["steps"][1], "fixed_ms": -1}}})
    with pytest.raises(ProfileError, match="missing field 'steps'"):
        profile_from_dict({k: v for k, v in body.items() if k != "steps"})
    (tmp_path / "bad.yaml").write_text("name: [")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(tmp_path / "bad.yaml")


def test_the_fit_recovers_a_known_step_model():
    truth = StepModel(6.0, 0.3, 0.12, 0.08, 0.4, kv_blocks=100)
    rng = random.Random(3)
    samples = []
    for _ in range(40):
        d, p = rng.choice([0, 1, 4, 8, 16]), rng.choice([0, 32, 128, 512])
        if not d and not p:
            p = 64
        pairs, ctx = p * rng.choice([0, 256]) + p * (p + 1) // 2, d * rng.choice([64, 512])
        samples.append((truth.step_ms(d, p, pairs, ctx) * rng.uniform(0.98, 1.02), d, p, pairs, ctx))
    got = fit_step_model(samples, kv_blocks=100)
    assert got.fixed_ms == pytest.approx(6.0, rel=0.1)
    assert got.prefill_ms_per_token == pytest.approx(0.12, rel=0.1)
    assert fit_error(got, samples) < 0.03


def test_measuring_a_profile_with_the_real_engine(llama_dir):
    from pdserve.sim.measure import measure_profile

    prof, err = measure_profile(llama_dir, repeats=1)
    m = prof.steps[1]
    assert m.prefill_ms_per_token > 0 and m.kv_blocks > 0 and prof.kv_bytes_per_token > 0
    assert err < 0.5  # a fit, not a guess (timings on a shared 2-core box are noisy)


def test_traces_round_trip_and_errors_name_the_line(tmp_path):
    reqs = generate(mix("prefix", 2.0, 20), seed=2)
    save_trace(reqs, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == reqs
    (tmp_path / "bad.jsonl").write_text('{"t": 0, "prompt_len": 5, "output_len": 2}\n{"t": 1, "prompt_len": 0, '
                                        '"output_len": 2}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: prompt_len must be an integer >= 1"):
        load_trace(tmp_path / "bad.jsonl")
    (tmp_path / "prio.jsonl").write_text(json.dumps({"t": 0, "prompt_len": 5, "output_len": 1,
                                                     "priority": "urgent"}) + "\n")
    with pytest.raises(WorkloadError, match="priority"):
        load_trace(tmp_path / "prio.jsonl")


def test_synthetic_mixes():
    assert generate(mix("long-prompt", 3.0, 50), 1) == generate(mix("long-prompt", 3.0, 50), 1)
    reqs = generate(WorkloadSpec(rate=10.0, num_requests=2000, arrival="gamma", burstiness_cv=3.0), 0)
    gaps = [b.t - a.t for a, b in zip(reqs, reqs[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert mean == pytest.approx(0.1, rel=0.15) and cv > 2.0
    a, b = SimRequest(1, 0, 600, 1, 0, 512), SimRequest(2, 0, 700, 1, 0, 512)
    assert a.token_ids()[:512] == b.token_ids()[:512] and a.token_ids()[512:520] != b.token_ids()[512:520]
    with pytest.raises(WorkloadError, match="unknown mix"):
        mix("chatty", 1.0, 1)
    with pytest.raises(WorkloadError, match="rate must be > 0"):
        generate(WorkloadSpec(rate=0.0), 0)


def test_cli_runs_and_refuses_bad_input(tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "h100.yaml"
    assert main(["sim", "profile", "--roofline", "llama-3-8b", "--gpu", "h100", "--tp", "1,2", "--out", str(out)]) == 0
    assert main(["sim", "run", "--profile", str(out), "--topology", "1P2D", "--mix", "decode-heavy", "--rate", "20",
                 "--requests", "60", "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "goodput" in printed and "60/60 completed" in printed
    assert json.loads((tmp_path / "r.json").read_text())["completed"] == 60
    # --explain: the reasons, and the costs each decode worker's router decided with at the end
    assert main(["sim", "run", "--profile", str(out), "--topology", "1P2D", "--mix", "long-prompt", "--rate", "20",
                 "--requests", "40", "--explain"]) == 0
    printed = capsys.readouterr().out
    assert "router reasons:" in printed
    assert printed.count("costs at the end: prefill local") == 2  # decode-0 and decode-1
    assert re.search(r"route (local|remote): \d+ requests, TTFT p50 [\d.]+ ms, the router predicted", printed)
    assert main(["sim", "run", "--profile", str(out), "--topology", "one-by-one"]) == 2
    assert "write XpYd" in capsys.readouterr().err
    assert main(["sim", "run", "--profile", str(out), "--decode-tp", "4"]) == 2
    assert "tensor_parallel_size 4" in capsys.readouterr().err
