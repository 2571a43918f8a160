"""bench/peer_serve.py without vLLM: the 1P1D topology it derives, the prediction figures it
reads from a decode worker's /metrics, its table."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from pdserve.bench.peer_serve import (PeerConfig, Server, format_table, parse_prediction_ratios, run_seed, saturated,
                                     summarize)
from pdserve.cluster.topology import load_topology
from pdserve.decode.metrics import WorkerMetrics


def test_the_derived_1p1d_topology_is_the_shipped_one_with_this_model_and_port(tmp_path, llama_dir):
    cfg = PeerConfig(model=llama_dir, port=18123, cpus="0,1", work_dir=str(tmp_path))
    topo = load_topology(Server(cfg, "1p1d", print)._topology())
    assert topo.model_path == Path(llama_dir).resolve()
    assert topo.roles.decode.ports["http"] == 18123
    assert (topo.roles.prefill.cpus, topo.roles.decode.cpus) == ([0], [1])
    assert topo.router_policy_path.name == "default.yaml"


def test_prediction_figures_come_from_the_ratio_histogram():
    m = WorkerMetrics("decode", "d0")
    for ratio in (0.95, 1.05, 1.2, 0.7, 3.0):  # three within 20 %, one over, one 3x under-predicted
        m.ttft_prediction("local", ratio)
    m.ttft_prediction("remote", 1.0)
    got = parse_prediction_ratios(generate_latest(m.registry).decode())
    assert got == {"local": {"requests": 5, "within_20pct": 0.6, "under_predicted_2x": 0.2},
                   "remote": {"requests": 1, "within_20pct": 1.0, "under_predicted_2x": 0.0}}


def test_the_table_gives_goodput_ratios_against_vllm():
    run = {"completed": 40, "num_prompts": 40, "request_throughput": 1.0, "p50_ttft_ms": 100.0, "p99_ttft_ms": 900.0,
           "p50_tpot_ms": 20.0, "p99_tpot_ms": 40.0, "p50_itl_ms": 20.0, "p99_itl_ms": 60.0,
           "goodput_min": 0.9, "goodput_max": 1.0}
    doc = {"config": {"goodput": ["ttft:1500", "tpot:50"], "reps": 1}, "results": {"long-mix": {
        "vllm": {"1": {"median": {**run, "request_goodput": 0.8}}},
        "colocated": {"1": {"median": {**run, "request_goodput": 1.0}}}}},
        "predictions": {"long-mix": {"colocated": {"local": {"requests": 40, "within_20pct": 0.75}}}}}
    table = format_table(doc)
    assert "| 1 | colocated | 40/40 | - | 1.00 [0.90-1.00] | 1.25x |" in table
    assert "local 75% of 40 requests" in table


def test_refusals_are_read_by_reason_and_differenced_per_run():
    from pdserve.bench.peer_serve import parse_refusals, refusals_between
    m = WorkerMetrics("decode", "d0")
    m.refused("queue_wait_exceeded")
    before = parse_refusals(generate_latest(m.registry).decode())
    for _ in range(3):
        m.refused("queue_wait_exceeded")
    m.refused("kv_pool_full")
    after = parse_refusals(generate_latest(m.registry).decode())
    assert before == {"queue_wait_exceeded": 1}
    assert refusals_between(before, after) == {"kv_pool_full": 1, "queue_wait_exceeded": 3}
    assert refusals_between(after, after) == {}


def test_saturation_is_requests_missing_their_slos_not_goodput_under_the_rate():
    # decode-heavy at 1 req/s: every request within its SLOs, but the last one's 256-token tail
    # stretches the run to 45 s, so goodput (0.89) is under 0.9 x the rate; not saturated.
    unsaturated = summarize({"request_goodput": 40 / 45, "duration": 45.0, "num_prompts": 40, "completed": 40})
    assert unsaturated["request_goodput"] < 0.9 * 1.0
    assert not saturated(unsaturated, 0.9)
    # 34 of 40 within the SLOs (85 %): saturated.
    missed = summarize({"request_goodput": 34 / 20, "duration": 20.0, "num_prompts": 40, "completed": 40})
    assert saturated(missed, 0.9) and not saturated(missed, 0.8)
    assert not saturated({}, 0.9)  # a run without goodput figures stops nothing


def test_the_tails_table_gives_p99_ratios_with_their_spread_over_repetitions():
    from pdserve.bench.peer_serve import median_of, tail_ratio

    def run(ttft, itl):
        return {"completed": 40, "num_prompts": 40, "request_goodput": 1.0, "request_throughput": 1.0,
                "p50_ttft_ms": 50.0, "p99_ttft_ms": ttft, "p50_tpot_ms": 5.0, "p99_tpot_ms": 9.0,
                "p50_itl_ms": 5.0, "p99_itl_ms": itl}

    vllm = median_of([run(100, 40), run(90, 44), run(110, 42)])
    ours = median_of([run(125, 20), run(120, 21), run(150, 22)])
    assert (vllm["p99_ttft_ms_min"], vllm["p99_ttft_ms_max"]) == (90, 110)
    ratio, worst, best = tail_ratio(vllm, ours, "p99_ttft_ms")
    assert (round(ratio, 3), round(worst, 3), round(best, 3)) == (0.8, 0.6, round(110 / 120, 3))
    assert tail_ratio(vllm, ours, "p99_itl_ms")[0] == 2.0  # 42 / 21: ours is half vLLM's
    doc = {"config": {"goodput": ["ttft:1500", "tpot:50"], "reps": 3}, "results": {"long-mix": {
        "vllm": {"1": {"median": vllm}}, "colocated": {"1": {"median": ours}}}}}
    table = format_table(doc)
    assert "| 1 | colocated | 125 [120-150] | 100 [90-110] | 0.80x [0.60-0.92] | 21 [20-22] | 42 [40-44] | 2.00x" in table
    one_system = format_table({**doc, "results": {"long-mix": {"vllm": {"1": {"median": vllm}}}}})
    assert "TTFT p99 vs vLLM" not in one_system


def test_the_cpu_by_thread_is_read_from_metrics_and_differenced_per_run():
    from pdserve.bench.peer_serve import cpu_split, parse_thread_cpu

    text = ('# HELP pdserve_thread_cpu_seconds_total CPU\n'
            'pdserve_thread_cpu_seconds_total{role="decode",thread="MainThread",worker_id="d"} 1.5\n'
            'pdserve_thread_cpu_seconds_total{role="decode",thread="pdserve-engine",worker_id="d"} 10.0\n'
            'pdserve_thread_cpu_seconds_total{role="decode",thread="native",worker_id="d"} 9.25\n'
            'pdserve_thread_cpu_seconds_created{role="decode",thread="native",worker_id="d"} 1.7e9\n')
    got = parse_thread_cpu(text)
    assert got == {"MainThread": 1.5, "pdserve-engine": 10.0, "native": 9.25}
    assert cpu_split({"MainThread": 1.0, "native": 9.25}, got) == {"MainThread": 0.5, "pdserve-engine": 10.0}


def test_a_rate_and_repetition_replay_the_same_prompts_whatever_the_rate_list():
    """The seed follows the rate's value, not its place in --rates: an ablation run at rate 4
    alone replays the prompts and arrivals of rate 4 in a 1,2.5,4 run."""
    seeds = {(rate, rep): run_seed(rate, rep) for rate in (1, 2.5, 4, 8) for rep in range(5)}
    assert len(set(seeds.values())) == len(seeds)  # every (rate, repetition) draws its own
    assert run_seed(4.0, 2) == run_seed(4, 2) == seeds[(4, 2)]
    assert run_seed(1, 0) == 1000  # rate 1 keeps the seeds it had as the first of a rate list
