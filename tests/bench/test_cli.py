"""`pdserve bench serve|sweep`: flags, help, errors, and one serve run against a real decode worker."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from pdserve.bench.cli import register
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve")
    register(p.add_subparsers(dest="command"))
    return p


def subparser(name: str) -> argparse.ArgumentParser:
    bench = next(a for a in parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("bench"))
    return bench._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("name", ["serve", "sweep"])
def test_every_flag_has_help_text(name, capsys):
    sp = subparser(name)
    undocumented = [a.option_strings for a in sp._actions if a.option_strings and not (a.help or "").strip()]
    assert undocumented == []
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["bench", name, "--help"])
    assert exc.value.code == 0
    assert "--goodput" in capsys.readouterr().out


def test_defaults():
    serve = parser().parse_args(["bench", "serve", "--target", "h:1"])
    assert math.isinf(serve.request_rate) and serve.burstiness == 1.0 and serve.dataset_name == "random"
    assert serve.ignore_eos and serve.goodput is None and serve.metric_percentiles == "50,90,99"
    sweep = parser().parse_args(["bench", "sweep"])
    assert sweep.dataset_name == "mixed" and sweep.num_workers == 2 and sweep.request_rates == [0.5, 1.0, 2.0]
    assert sweep.goodput == ["ttft:500", "tpot:50"] and sweep.admission == "slo"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--target", "h:1", "--goodput", "itl:5"], "--goodput"),
    (["serve", "--target", "h:1", "--metric-percentiles", "50,100"], "--metric-percentiles"),
    (["serve"], "--target"),
    (["sweep", "--modes", "colocated,fast"], "--modes"),
    (["sweep", "--num-workers", "1"], "--num-workers"),
    (["sweep", "--request-rates", "1", "2", "--cdf-rate", "3"], "--cdf-rate"),
])
def test_bad_values_are_errors_naming_the_flag(argv, message):
    args = parser().parse_args(["bench", *argv])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_a_rate_must_be_positive():
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "serve", "--request-rate", "0"])


@pytest.fixture(scope="module")
def worker(llama_dir, tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text("router: {mode: always_local}\nqos: {enable_early_rejection: false}\n")
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512},
                                        router_policy=str(policy))).start()
    yield w
    w.stop()


def test_serve_against_a_decode_worker_writes_vllm_style_results(worker, tmp_path, capsys):
    result = tmp_path / "result.json"
    args = parser().parse_args([
        "bench", "serve", "--target", worker.grpc, "--dataset-name", "random", "--num-prompts", "8",
        "--random-input-len", "20", "--random-output-len", "5", "--random-range-ratio", "0.5",
        "--request-rate", "20", "--max-concurrency", "3", "--goodput", "ttft:60000", "--no-progress",
        "--metric-percentiles", "50,99.9", "--result-file", str(result)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    doc = json.loads(result.read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0 and doc["request_rate"] == 20.0
    assert doc["max_concurrency"] == 3 and doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    assert "p99.9_ttft_ms" in doc and "p90_ttft_ms" not in doc
    assert doc["total_output_tokens"] == sum(r["output_len"] for r in doc["requests"])
    assert doc["total_input_tokens"] == sum(r["prompt_len"] for r in doc["requests"])
    assert doc["route_mix"]["routes"] == {"local": 8}


def test_a_run_is_bounded_by_duration_and_drain_timeout(worker):
    import asyncio
    import time

    from pdserve.bench.datasets import DatasetConfig, load_dataset
    from pdserve.bench.serve import LoadConfig, run_load

    reqs = load_dataset(DatasetConfig("random", num_prompts=200, input_len=16, output_len=400), 32000)
    cfg = LoadConfig(request_rate=10.0, duration_s=0.5, drain_timeout_s=0.3, seed=2, progress=False)
    t0 = time.monotonic()
    records, duration = asyncio.run(run_load([worker.grpc], reqs, cfg))
    assert time.monotonic() - t0 < 5.0
    assert 1 <= len(records) < 20 and all(r.scheduled_s <= 0.5 for r in records)
    cancelled = [r for r in records if r.error.startswith("CANCELLED")]
    assert cancelled and not any(r.success for r in cancelled)  # 400 tokens do not fit in 0.3 s
    assert duration == max(r.end_s for r in records) and duration < 2.0
