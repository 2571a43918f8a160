"""A LoRA adapter across the prefill/decode handoff, piece by piece (docs/lora.md, "Across
prefill and decode"): the task names the adapter on the wire and under its signature (a base
task's wire and signed bytes are what they were), the notice says which adapter its pages were
computed under, the decode side refuses pages of another adapter (`AdapterMismatchError` naming
the field), the decode worker's view of the prefill workers' records, the cost model's adapter
load, and the router's reasons with `pdserve policy explain`."""

from __future__ import annotations

import argparse
import dataclasses
import time

import msgpack
import pytest

from pdserve.cluster.queue.frames import from_wire, pack_frame, to_wire
from pdserve.cluster.queue.signing import BAD_SIGNATURE, SIGNATURE_CONTEXT, TaskSigner, signed_message, verify_task
from pdserve.cluster.records import WorkerInfo
from pdserve.decode.prefill_pool import PrefillView
from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
from pdserve.kvtransfer.decode_side import WRONG_ADAPTER, AdapterMismatchError, check_adapter
from pdserve.kvtransfer.task import TaskFormatError, task_from_wire, task_to_wire
from pdserve.router import cli
from pdserve.router.costs import CostEstimates, CostModel
from pdserve.router.decide import decide
from pdserve.router.policy import CostModelParams, RouterPolicy
from pdserve.router.values import ClusterSnapshot, RequestFeatures

SQL = {"lora_name": "sql", "lora_int_id": 1, "lora_path": "/adapters/sql"}


def task(**fields) -> PrefillTask:
    return PrefillTask(request_id="r1", epoch=1, token_ids=list(range(3, 40)), cached_len=16,
                       target_worker_id="decode-0", target_block_ids=[4, 5, 6], deadline=time.time() + 60,
                       sampling_params={"temperature": 0.0}, **fields)


# -- the task -------------------------------------------------------------------------------
def test_the_task_carries_its_adapter_on_the_wire_and_a_base_task_reads_as_before():
    t = task(**SQL)
    wire = task_to_wire(t)
    assert {k: wire[k] for k in SQL} == SQL
    back = task_from_wire(wire)
    assert (back.lora_name, back.lora_int_id, back.lora_path) == ("sql", 1, "/adapters/sql")
    base = task_to_wire(task())
    assert not set(SQL) & set(base)  # (a worker of an earlier version reads it)
    assert task_from_wire(base).lora_name == ""
    # and through the queue's own frames (msgpack, never pickle)
    framed = msgpack.unpackb(pack_frame(to_wire(t))[4:], raw=False)
    again = from_wire(PrefillTask, framed, "task")
    assert (again.lora_path, again.lora_int_id) == ("/adapters/sql", 1)


@pytest.mark.parametrize("fields, words", [
    ({"lora_name": "sql", "lora_int_id": 1}, "all set, or none"),  # no path to load it from
    ({"lora_path": "/a", "lora_int_id": 1}, "all set, or none"),
    ({"lora_int_id": 3}, "all set, or none"),
    ({**SQL, "lora_int_id": -1}, "lora_int_id"),
    ({**SQL, "lora_int_id": True}, "lora_int_id"),
    ({**SQL, "lora_name": 7}, "lora_name"),
])
def test_a_half_named_adapter_is_refused_naming_the_fields(fields, words):
    with pytest.raises(ValueError, match=words):
        task(**fields)
    wire = {**task_to_wire(task()), **fields}
    with pytest.raises((TaskFormatError, ValueError), match=words):
        task_from_wire(wire)


def test_the_signature_covers_the_adapter_and_a_base_tasks_bytes_are_unchanged():
    signer = TaskSigner()
    t = signer.sign(task(**SQL))
    assert verify_task(t, signer.public_key) is None
    for change in ({"lora_path": "/tmp/evil"}, {"lora_name": "chat"}, {"lora_int_id": 2},
                   {"lora_name": "", "lora_int_id": 0, "lora_path": ""}):
        forged = dataclasses.replace(t, **change)
        forged.signature = t.signature
        assert verify_task(forged, signer.public_key) == BAD_SIGNATURE, change
    base = task()
    body = msgpack.unpackb(signed_message(base)[len(SIGNATURE_CONTEXT):])
    assert len(body) == 11 and body[-1] == "decode-0"  # the fields of before, origin last
    assert signed_message(t) != signed_message(dataclasses.replace(t, lora_name="", lora_int_id=0, lora_path=""))


# -- the notice and the arrival check --------------------------------------------------------
def test_the_notice_names_its_adapter_and_a_base_notice_encodes_as_before():
    done = PrefillDone("r1", 1, 42, -0.5, 21, lora_name="sql", lora_int_id=1, lora_load_ms=12.5)
    back = decode_notification(done.encode())
    assert (back.lora_name, back.lora_int_id, back.lora_load_ms) == ("sql", 1, 12.5)
    base = PrefillDone("r1", 1, 42, -0.5, 21).encode()
    assert b"lora" not in base
    assert decode_notification(base).lora_name == ""
    for bad in ({"lora_int_id": -1}, {"lora_name": 3}, {"lora_load_ms": -1.0}):
        with pytest.raises(ValueError):
            PrefillDone("r1", 1, 42, -0.5, 21, **bad)


def test_pages_of_another_adapter_or_of_the_base_are_refused_naming_the_field():
    check_adapter(task(**SQL), "sql", 1)  # the adapter the task named: fine
    check_adapter(task(), "", 0)  # the base for the base
    cases = [(task(**SQL), "chat", 2, "lora_name"),  # another adapter
             (task(**SQL), "", 0, "lora_name"),  # the base model's KV for an adapter's request
             (task(), "sql", 1, "lora_name"),  # an adapter's KV for a base request
             (task(**SQL), "sql", 7, "lora_int_id")]  # the name, but another adapter behind it
    for t, name, lid, field_name in cases:
        with pytest.raises(AdapterMismatchError) as err:
            check_adapter(t, name, lid)
        assert err.value.field == field_name and err.value.reason == WRONG_ADAPTER
        assert str(err.value).startswith(f"{field_name}: ")


# -- what a decode worker knows of the prefill workers ----------------------------------------
def test_the_view_counts_the_prefill_workers_that_run_adapters_and_what_they_hold():
    def rec(wid, capacity, load):
        return WorkerInfo(worker_id=wid, role="prefill", capacity=capacity, load=load)

    view = PrefillView()
    view.count_adapters([rec("p0", {"enable_lora": True}, {"lora_adapters": ["chat", "sql"]}),
                         rec("p1", {"enable_lora": True}, {}),  # no load report yet
                         rec("p2", {}, {"lora_adapters": ["x"]}),  # (runs none: its list is not believed)
                         rec("p3", {"enable_lora": True}, {"lora_adapters": "sql"})])  # malformed: ignored
    assert view.lora_workers == 3 and view.lora_adapters == {"chat", "sql"}
    view.count_adapters([])
    assert view.lora_workers == 0 and view.lora_adapters == frozenset()


# -- the router -----------------------------------------------------------------------------
def policy(**router) -> RouterPolicy:
    """The ITL weight these checks were written with (0.1; the shipped 1.0 makes the 8 decoding
    streams' stall outweigh any adapter load)."""
    router.setdefault("cost_model", {"itl_penalty_weight": 0.1})
    return RouterPolicy.model_validate({"router": router})


def snapshot(p: RouterPolicy, lora_pool_size: int, **costs) -> ClusterSnapshot:
    seeded = dataclasses.replace(CostEstimates.seed(p.router.cost_model, 128 * 1024), **costs)
    return ClusterSnapshot(costs=seeded, prefill_pool_size=2, decode_active_requests=8,
                           lora_pool_size=lora_pool_size)


def lora_req(held: bool = False, **fields) -> RequestFeatures:
    return RequestFeatures(prompt_len=4000, lora_adapter=True, lora_held_remote=held, **fields)


def test_lora_adapter_stays_the_reason_when_no_prefill_worker_runs_adapters():
    for p, override in ((policy(mode="always_remote"), "remote"), (policy(), "auto")):
        d = decide(lora_req(override=override), snapshot(p, 0), p, explain=True)
        assert (d.route, d.reason) == ("local", "lora_adapter")
        assert any("no live prefill worker runs adapters" in line for line in d.trace)


def test_an_adapter_request_goes_remote_when_a_prefill_worker_runs_adapters():
    p = policy(mode="always_remote")
    assert decide(lora_req(), snapshot(p, 1), p).route == "remote"
    p = policy()
    assert decide(lora_req(override="remote"), snapshot(p, 1), p).reason == "override_remote"
    d = decide(lora_req(held=True), snapshot(p, 1), p)
    assert (d.route, d.reason) == ("remote", "cost_remote_cheaper")


def test_the_cost_model_counts_the_adapter_load_only_when_no_prefill_worker_holds_it():
    p = policy()
    snap = snapshot(p, 1, lora_load_ms=400.0)
    held = decide(lora_req(held=True), snap, p)
    loading = decide(lora_req(held=False), snap, p, explain=True)
    assert loading.predicted_ttft_remote_ms == pytest.approx(held.predicted_ttft_remote_ms + 400.0)
    assert loading.predicted_ttft_local_ms == held.predicted_ttft_local_ms
    assert held.route == "remote" and (loading.route, loading.reason) == ("local", "lora_adapter_load")
    assert "loading it (400.0 ms)" in loading.detail
    assert any("none of them holds it" in line and "400.0 ms" in line for line in loading.trace)
    # a load too small to change the choice leaves it with the cost model's own reason
    cheap = decide(lora_req(), snapshot(p, 1, lora_load_ms=1.0), p)
    assert (cheap.route, cheap.reason) == ("remote", "cost_remote_cheaper")
    # and a base request is priced as before, whatever the adapter figures
    base = RequestFeatures(prompt_len=4000)
    assert decide(base, snap, p).predicted_ttft_remote_ms == decide(base, snapshot(p, 0), p).predicted_ttft_remote_ms


def test_the_load_time_is_seeded_by_the_policy_then_measured():
    model = CostModel(CostModelParams(lora_load_ms=80.0), 1024)
    assert model.snapshot().lora_load_ms == 80.0
    model.observe_lora_load(20.0)
    assert model.snapshot().lora_load_ms == pytest.approx(80.0 + 0.2 * (20.0 - 80.0))  # an EMA (ema_alpha 0.2)
    model.update_params(CostModelParams(lora_load_ms=500.0))
    assert model.snapshot().lora_load_ms == pytest.approx(68.0)  # measured: a reloaded policy keeps it
    fresh = CostModel(CostModelParams(), 1024)
    fresh.update_params(CostModelParams(lora_load_ms=500.0))
    assert fresh.snapshot().lora_load_ms == 500.0  # unmeasured: the new seed
    with pytest.raises(ValueError):
        model.observe_lora_load(-1.0)


def run_explain(capsys, *flags: str) -> str:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["policy", "explain", "configs/router/default.yaml", "--prompt-len", "4000",
                              "--decode-active", "1", *flags])  # (one stream's stall: the load decides)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_policy_explain_shows_why_an_adapter_request_stays_local(capsys, monkeypatch):
    from pathlib import Path
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    out = run_explain(capsys, "--lora-adapter")
    assert "decision: local (lora_adapter)" in out
    out = run_explain(capsys, "--lora-adapter", "--lora-pool-size", "1", "--lora-load-ms", "400")
    assert "decision: local (lora_adapter_load" in out
    assert "none of them holds it: a remote prefill loads it first, 400.0 ms" in out
    out = run_explain(capsys, "--lora-adapter", "--lora-pool-size", "1", "--lora-load-ms", "400",
                      "--lora-held-remote")
    assert "decision: remote (cost_remote_cheaper" in out and "one of them holds it" in out
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    bad = parser.parse_args(["policy", "explain", "configs/router/default.yaml", "--prompt-len", "10",
                             "--lora-pool-size", "-1"])
    assert bad.func(bad) == 1
    assert "--lora-pool-size must be >= 0" in capsys.readouterr().err


# -- the prefill worker's admission of a task -------------------------------------------------
def test_a_prefill_engine_loads_the_tasks_adapter_once_and_refuses_what_it_cannot_run(llama_dir, tmp_path):
    from pdserve.engine import LLM, InvalidRequestError
    from pdserve.prefill.admit import TaskAdmission
    from tests.engine.test_lora import make_adapter

    path = make_adapter(llama_dir, str(tmp_path / "sql"), 4, 8, ["q_proj"], seed=5)
    sql = {"lora_name": "sql", "lora_int_id": 1, "lora_path": path}
    with LLM(llama_dir, max_model_len=256) as plain:  # no enable_lora: its tasks are refused
        with pytest.raises(InvalidRequestError) as err:
            TaskAdmission(plain.engine).admit(task(**sql))
        assert err.value.field == "lora_request"
    with LLM(llama_dir, max_model_len=256, enable_lora=True, max_loras=1) as llm:
        adm = TaskAdmission(llm.engine)
        assert adm.enabled and adm.load() == {"lora_adapters": []}
        rid = adm.admit(task(**sql))
        assert adm.load_ms(rid) > 0 and adm.load_ms(rid) == 0.0  # timed once, forgotten once read
        again = adm.admit(dataclasses.replace(task(**sql), request_id="r2"))
        assert adm.load_ms(again) == 0.0  # held: no load
        adm.refresh()
        assert adm.held == ("sql",) and adm.load() == {"lora_adapters": ["sql"]}
        for bad, field_name in (({**sql, "lora_path": str(tmp_path / "missing"), "lora_name": "x",
                                  "lora_int_id": 9}, "lora_request.lora_path"),
                                ({**sql, "lora_int_id": 2}, "lora_request.lora_name")):  # one name, one adapter
            with pytest.raises(InvalidRequestError) as err:
                adm.admit(dataclasses.replace(task(**bad), request_id=f"r-{field_name}"))
            assert err.value.field == field_name


# -- the queue ------------------------------------------------------------------------------
def test_the_queue_hands_an_adapters_task_only_to_a_worker_that_runs_adapters():
    from pdserve.cluster.queue.core import QueueCore

    q = QueueCore()
    lora_task = dataclasses.replace(task(**SQL), request_id="lora", priority="high")  # the head of the queue
    base_task = dataclasses.replace(task(), request_id="base")
    assert q.put(lora_task).ok and q.put(base_task).ok
    assert [t.request_id for t in q.take("plain", 10_000)] == ["base"]  # looked past the adapter's task
    assert q.take("plain", 10_000) == []
    assert [t.request_id for t in q.take("lora-worker", 10_000, adapters=True)] == ["lora"]
