"""`pdserve policy check|explain` through the subcommand registration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.router import cli

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_check_accepts_every_shipped_config(capsys):
    files = sorted(str(p) for d in ("router", "autoscale") for p in (REPO / "configs" / d).glob("*.yaml"))
    assert run(["policy", "check", *files]) == 0
    out = capsys.readouterr().out
    assert out.count(": OK (") == len(files)
    assert "default.yaml: OK (autoscale policy)" in out
    assert "default.yaml: OK (router policy, mode conditional, policy cost_model)" in out


def test_check_reports_key_and_line_and_fails(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  policy: threshold\n  threshold:\n    prefill_queue_max: many\n")
    good = REPO / "configs/router/score.yaml"
    assert run(["policy", "check", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:4:5: router.threshold.prefill_queue_max: Input should be a valid integer" in out
    assert "score.yaml: OK" in out


def test_check_refuses_worker_selection_saying_why_and_what_to_do(tmp_path, capsys):
    old = tmp_path / "old-default.yaml"
    old.write_text("router:\n  mode: conditional\n  worker_selection:\n    decode:\n      strategy: kv_aware\n")
    assert run(["policy", "check", str(old)]) == 1
    out = capsys.readouterr().out
    assert f"{old}: INVALID" in out
    assert f"{old}:3:3: router.worker_selection: not used yet:" in out
    assert "delete the worker_selection block" in out


def test_check_validates_autoscale_files_against_their_schema(tmp_path, capsys):
    bad = tmp_path / "scale.yaml"
    bad.write_text("autoscale:\n  max_step: 0\n")
    assert run(["policy", "check", str(bad)]) == 1
    assert "scale.yaml:2:3: autoscale.max_step" in capsys.readouterr().out


def test_check_of_a_missing_file_fails(tmp_path, capsys):
    assert run(["policy", "check", str(tmp_path / "none.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().out


def test_explain_prints_decision_predictions_and_reasoning(capsys):
    code = run([
        "policy", "explain", str(REPO / "configs/router/threshold.yaml"),
        "--prompt-len", "300", "--cached-len", "20", "--queue-depth", "3", "--pool-size", "2",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert "eff_len = max(0, prompt_len 300 - cached_len 20) = 280" in out
    assert "eff_len 280 >= prefill_length_threshold 256: True" in out
    assert "decision: remote (threshold_long_prompt)" in out
    assert "predicted TTFT: local 38.0 ms, remote" in out  # 280 x 0.1 + one step's fixed 10 ms
    assert "admission: admit (admitted)" in out


def test_explain_shows_a_forced_override(capsys):
    run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "5000",
         "--override", "local", "--decode-active", "30"])
    assert "decision: local (override_local)" in capsys.readouterr().out


def test_explain_shows_a_refusal_with_the_predicted_ttft(capsys):
    run(["policy", "explain", str(REPO / "configs/router/always-local.yaml"), "--prompt-len", "1000",
         "--priority", "low", "--local-queue-tokens", "12000"])
    out = capsys.readouterr().out
    # (12000 + 1000) x 0.1 ms + one step's fixed 10 ms, over the default threshold of 1000 ms
    assert "admission: refuse (low_priority_ttft): predicted TTFT 1310 ms exceeds low_priority_threshold_ms 1000" in out


def test_explain_uses_calibrated_costs_given_on_the_command_line(capsys):
    run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "2000",
         "--decode-active", "1", "--transfer-gb-per-s", "0.5"])
    out = capsys.readouterr().out
    assert "transfer 0.5 GB/s" in out
    assert "decision: local (cost_local_cheaper" in out


def test_explain_of_an_invalid_policy_fails_with_the_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  mode: maybe\n")
    assert run(["policy", "explain", str(bad), "--prompt-len", "10"]) == 1
    assert "bad.yaml:2:3: router.mode" in capsys.readouterr().err


def test_explain_refuses_a_nonsense_cost(capsys):
    code = run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "10",
                "--transfer-gb-per-s", "0"])
    assert code == 1
    assert "--transfer-gb-per-s must be > 0" in capsys.readouterr().err


def test_policy_without_subcommand_prints_usage(capsys):
    assert run(["policy"]) == 2
    assert "check" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--priority", "--override"])
def test_explain_rejects_unknown_choices(flag):
    with pytest.raises(SystemExit):
        run(["policy", "explain", "x.yaml", "--prompt-len", "1", flag, "bogus"])


def test_explain_refuses_a_percentage_kv_usage(capsys):
    code = run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "10",
                "--kv-usage", "75"])
    assert code == 1
    assert "--kv-usage is a fraction 0-1" in capsys.readouterr().err


def test_explain_shows_the_chosen_k_and_prices_the_step_per_token(capsys):
    # k = 4 at batch 4 (3 decoding + this one); acceptance 0.5 gives 1 + .5 + .25 + .125 + .0625
    # = 1.9375 tokens a step: a 31 ms step is 16 ms per token, the TPOT the router weighs
    assert run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "900",
                "--decode-active", "3", "--decode-step-ms", "31", "--spec-k", "4", "--spec-acceptance", "0.5"]) == 0
    out = capsys.readouterr().out
    assert ("speculative decoding: k = 4 proposals per step for a stream admitted now (batch 4); a verifying "
            "step gives a stream 1.94 tokens on average; decode step 16.0 ms is per token emitted") in out


def test_explain_shows_no_proposals_past_the_batch_rule_and_none_without_speculation(capsys):
    run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "900",
         "--decode-active", "32", "--spec-k", "4"])
    assert "no proposals for a stream admitted now (batch 33 is past the load rule)" in capsys.readouterr().out
    run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "900",
         "--decode-active", "32", "--spec-k", "4", "--spec-disable-by-batch-size", "64"])
    assert "k = 4 proposals per step for a stream admitted now (batch 33)" in capsys.readouterr().out
    run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "900"])
    assert "speculative decoding" not in capsys.readouterr().out


@pytest.mark.parametrize("flags,needle", [
    (["--spec-k", "17"], "--spec-k"),
    (["--spec-k", "2", "--spec-acceptance", "1.5"], "--spec-acceptance"),
    (["--spec-acceptance", "0.5"], "--spec-acceptance needs --spec-k"),
    (["--spec-k", "2", "--spec-disable-by-batch-size", "0"], "--spec-disable-by-batch-size"),
])
def test_explain_refuses_bad_speculation_flags(flags, needle, capsys):
    assert run(["policy", "explain", str(REPO / "configs/router/default.yaml"), "--prompt-len", "9", *flags]) == 1
    assert needle in capsys.readouterr().err
