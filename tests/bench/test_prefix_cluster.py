"""bench/prefix_cluster.py's client: a refused turn is retried as the OpenAI SDK retries a 429."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from bench.prefix_cluster import retry_delay_s


def refusal(code=grpc.StatusCode.RESOURCE_EXHAUSTED, hint: str | None = None) -> AioRpcError:
    trailers = Metadata(("retry-after-ms", hint)) if hint is not None else Metadata()
    return AioRpcError(code, Metadata(), trailers, details="the KV pool has 208 free token slots")


def test_a_refusal_waits_for_the_servers_hint():
    assert retry_delay_s(refusal(hint="350"), 0, 2) == pytest.approx(0.35)
    assert retry_delay_s(refusal(hint="350"), 1, 2) == pytest.approx(0.35)


def test_without_a_usable_hint_the_wait_doubles_and_is_capped():
    assert retry_delay_s(refusal(), 0, 9) == pytest.approx(0.5)
    assert retry_delay_s(refusal(), 2, 9) == pytest.approx(2.0)
    assert retry_delay_s(refusal(), 8, 9) == pytest.approx(8.0)
    assert retry_delay_s(refusal(hint="soon"), 1, 9) == pytest.approx(1.0)
    assert retry_delay_s(refusal(hint="120000"), 0, 9) == pytest.approx(0.5), "a hint over 60 s is not honoured"


def test_spent_retries_and_other_errors_are_not_retried():
    assert retry_delay_s(refusal(hint="100"), 2, 2) is None
    assert retry_delay_s(refusal(hint="100"), 0, 0) is None
    assert retry_delay_s(refusal(grpc.StatusCode.INVALID_ARGUMENT, "100"), 0, 2) is None
    assert retry_delay_s(RuntimeError("stream broke"), 0, 2) is None


def test_every_mode_runs_the_same_chats_with_the_same_pauses():
    """The pauses are part of the workload, drawn up front from the seed: a mode's order of
    replies must not decide which chat waits how long (it decided the run's length)."""
    from bench.prefix_cluster import make_chats, parse_args

    args = parse_args(["--chats", "5", "--turns", "4", "--think-s", "3"])
    a, b = make_chats(args, 1000), make_chats(args, 1000)
    assert [c["thinks"] for c in a] == [c["thinks"] for c in b]
    assert all(len(c["thinks"]) == 3 and all(t > 0 for t in c["thinks"]) for c in a)
    assert len({t for c in a for t in c["thinks"]}) == 15, "each pause is drawn, not one value reused"
    assert all(t == 0 for c in make_chats(parse_args(["--think-s", "0"]), 1000) for t in c["thinks"])


def test_equal_memory_gives_a_mode_without_a_tier_the_tiers_bytes_in_its_pool():
    """Every mode holds the same KV bytes per worker (the issue's like-with-like): a tier mode
    gets pool + tier, a mode without one gets both in its pool; ``--memory pool`` is the old,
    unequal setup (only the tier modes get the extra bytes)."""
    from bench.prefix_cluster import MODES, memory_of, parse_args

    args = parse_args(["--pool-tokens", "1000"])
    args.kv_bytes_per_token = 8
    totals = {m: sum(memory_of(args, m)) for m in MODES}
    assert set(totals.values()) == {16000}, totals
    assert memory_of(args, "tier") == (8000, 8000) and memory_of(args, "all") == (8000, 8000)
    assert memory_of(args, "blind") == (16000, 0) and memory_of(args, "routing+lending") == (16000, 0)
    args = parse_args(["--pool-tokens", "1000", "--memory", "pool", "--tier-bytes", "3000"])
    args.kv_bytes_per_token = 8
    assert memory_of(args, "blind") == (8000, 0) and memory_of(args, "all") == (8000, 3000)


def test_modes_rotate_each_repetition_and_bad_modes_are_refused(capsys):
    import pytest

    from bench.prefix_cluster import parse_args, rep_order

    args = parse_args(["--modes", "kv-blind,tier,kv-aware"])
    assert args.mode_list == ["blind", "tier", "all"]
    assert [rep_order(args.mode_list, r)[0] for r in range(4)] == ["blind", "tier", "all", "blind"]
    assert sorted(rep_order(args.mode_list, 2)) == sorted(args.mode_list)
    for bad in (["--modes", "blind,lending"], ["--modes", "all,kv-aware"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "lending" in capsys.readouterr().err


def test_each_mode_turns_on_only_its_mechanisms(tmp_path):
    """The derived topologies: events only with routing, loans only with lending, a tier only
    in the tier modes; every mode the same longest prompt."""
    import yaml

    from bench.prefix_cluster import MODES, derive_topology, parse_args

    args = parse_args(["--pool-tokens", "2048"])
    args.kv_bytes_per_token = 4
    seen = {}
    for mode in MODES:
        topo = yaml.safe_load(derive_topology(args, mode, str(tmp_path), tmp_path).read_text())
        keys = ("kv_events", "kv_offload_bytes", "kv_cache_memory_bytes", "max_model_len")
        engines = [{k: topo["roles"][r]["engine"].get(k) for k in keys} for r in ("prefill", "decode")]
        assert engines[0] == engines[1], "both roles get the same memory and mechanisms"
        e = engines[0]
        seen[mode] = (e["kv_events"], topo["network"]["kv_transport"]["lending"], e["kv_offload_bytes"] or 0,
                      e["kv_cache_memory_bytes"], e["max_model_len"])
    assert seen["blind"] == (False, False, 0, 16384, 2048)
    assert seen["tier"] == (False, False, 8192, 8192, 2048)
    assert seen["routing"] == (True, False, 0, 16384, 2048)
    assert seen["routing+lending"] == (True, True, 0, 16384, 2048)
    assert seen["all"] == (True, True, 8192, 8192, 2048)


def test_each_mode_is_compared_with_the_kv_blind_cluster_of_its_memory_layout(tmp_path, capsys):
    """A tier mode against `tier` (same pool, same tier), the others against `blind` (same
    pool); the recorded JSON prints the same tables again (--report)."""
    import json

    from bench.prefix_cluster import MODES, baseline_of, main

    assert {m: baseline_of(m) for m in MODES} == {"blind": None, "tier": "blind", "routing": "blind",
                                                  "routing+lending": "blind", "all": "tier"}
    run = {"completed": 2, "requests": 2, "ttft_p50_ms": 10.0, "later_turns_ttft_p90_ms": 20.0, "tpot_p50_ms": 5.0,
           "server_ttft_p90_ms": 19.0, "client_lag_p99_ms": 1.0, "client_lag_max_ms": 2.0, "good": 2,
           "sources": {"computed": 1, "pool": 1, "tier": 0, "peer": 0}, "pool_bytes": 2 << 20, "tier_bytes": 0}
    runs = [{**run, "rep": 1, "mode": "blind", "ttft_p90_ms": 300.0, "goodput_rps": 1.0},
            {**run, "rep": 1, "mode": "tier", "ttft_p90_ms": 200.0, "goodput_rps": 1.5},
            {**run, "rep": 1, "mode": "all", "ttft_p90_ms": 100.0, "goodput_rps": 3.0}]
    args = {"chats": 2, "turns": 1, "systems": 1, "system_len": 8, "think_s": 1.0, "pool_tokens": 64,
            "memory": "equal", "slo_ttft_ms": 1000.0, "slo_tpot_ms": 100.0, "reps": 1}
    path = tmp_path / "prefix_cluster.json"
    path.write_text(json.dumps({"args": args, "working_set_tokens": 100, "runs": runs}))
    assert main(["--report", str(path)]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and " | " in line}
    assert "| 1.50x | 1.50x |" in rows["tier"]  # 300/200 against blind
    assert "| 2.00x | 2.00x |" in rows["all"]  # 200/100 against tier, not 3.00x against blind
