"""Both sides of the protocol, driven together through every failure reason of the table.

For each reason in kvtransfer/outcomes.py, a real prefill batch (prefill/batch.py
on a real engine) fails the way that reason arises, and its decode worker's
real engine holds a real reservation for the attempt. What the prefill side
sends (a PrefillFailed over the transport, or the reason on the queue's
failed list) is fed to the decode side's table (kvtransfer/decode_side.py), whose
effects are applied to the decode engine through its KV connector as the
Effect enum documents. Then both sides' final states and who owns which
blocks are checked: the prefill engine keeps nothing; the decode engine frees
the reservation at once when no write can still land, and otherwise holds it
under the quarantine key until the attempt's late notice frees it.

The transport here is a scripted in-process one (writes succeed, fail or time
out as the case asks): the real NIXL transport is covered by tests/kvtransfer
and the e2e suite; this test is about the protocol's two state machines.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kvtransfer import (
    Effect,
    Handoffs,
    HandoffState,
    JobState,
    PrefillDone,
    PrefillTask,
    WriteFailed,
    WriteTimedOut,
    decode_notification,
    fallback_reason,
    is_settled,
)
from pdserve.kvtransfer.outcomes import (
    BAD_TASK,
    BATCH_FAILED,
    CANCELLED,
    DEADLINE_EXPIRED,
    FAILURES,
    NO_LIVE_WORKER,
    PEER_MISSING,
    QUEUE,
    REQUEST_FAILED,
    TARGET_GONE,
    TRANSFER_ERROR,
    WORKER_STALLED,
    WORKER_VANISHED,
)
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.values import PrefillStats

DECODE, PREFILL = "d0", "p0"
PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16


class Handle:
    def __init__(self, num_bytes: int, outcome: str):
        self.num_bytes, self.outcome, self.finished = num_bytes, outcome, False


class ScriptedTransport:
    """A KVSender whose page writes land, fail or time out as `outcome` says; notices are kept."""

    def __init__(self, outcome: str = "ok"):
        self.outcome = outcome
        self.peers = {DECODE}
        self.sent: list[bytes] = []  # notices, in order (a PrefillDone rides behind its write)

    def write_blocks(self, peer, local_block_ids, remote_block_ids, *, notify=None):
        assert len(local_block_ids) == len(remote_block_ids)
        handle = Handle(64 * len(local_block_ids), self.outcome)
        if self.outcome == "ok" and notify is not None:
            self.sent.append(notify)
        return handle

    def begin_stream(self, peer, local_block_ids, remote_block_ids, notify=None):
        raise AssertionError("this test runs whole-request writes")

    def wait(self, handle, timeout_s):
        handle.finished = True  # landed, failed, or (timed out) abandoned by the agent: never waited again
        if handle.outcome == "fail":
            raise WriteFailed("the link went down")
        if handle.outcome == "timeout":
            raise WriteTimedOut(f"not complete after {timeout_s} s")
        return handle

    def send_notification(self, peer, payload):
        self.sent.append(payload)

    def poll(self):
        return type("Polled", (), {"notifications": []})()


@pytest.fixture(scope="module")
def engines(llama_dir):
    config = dict(num_gpu_blocks_override=32, max_num_batched_tokens=256, device="cpu")
    return (LLMEngine(EngineConfig.from_kwargs(llama_dir, **config)),
            LLMEngine(EngineConfig.from_kwargs(llama_dir, **config)))


def apply(step, eng) -> None:
    """The decode worker's effect on its engine (decode/kv_arrival.py KVArrival.apply, as the
    Effect enum documents it)."""
    h, c = step.handoff, eng.connector
    quarantine = h.quarantine_key if step.effect in (Effect.FALL_BACK_QUARANTINE, Effect.ABORT_QUARANTINE) else None
    if step.effect is Effect.RUN:
        c.remote_ready(h.request_id, 7)
    elif step.effect in (Effect.FALL_BACK, Effect.FALL_BACK_QUARANTINE):
        c.fall_back(h.request_id, quarantine)
    elif step.effect in (Effect.ABORT, Effect.ABORT_QUARANTINE):
        c.abort(h.request_id, quarantine)
    elif step.effect is Effect.FREE:
        c.free(h.quarantine_key)


def decode_reserves(eng, handoffs: Handoffs, rid: str, prompt=PROMPT) -> tuple[PrefillTask, list[int]]:
    req = eng.make_request(prompt, SamplingParams(max_tokens=4), request_id=rid)
    res = eng.connector.reserve(req)
    assert res is not None and res.cached_len == 0
    handoffs.reserve(rid, 1, len(res.block_ids))
    task = PrefillTask(rid, 1, prompt, res.cached_len, DECODE, res.block_ids, {"max_tokens": 4})
    assert not handoffs.queued(rid, 1, task).stale
    return task, res.block_ids


def prefill_fails(eng, task: PrefillTask, reason: str, monkeypatch) -> tuple[list, ScriptedTransport]:
    """Run one batch that fails as `reason` arises; returns its failures and the transport."""
    transport = ScriptedTransport({TRANSFER_ERROR: "fail", "transfer_timeout": "timeout"}.get(reason, "ok"))
    batch = PrefillBatch(PREFILL, eng, transport, PrefillStats(), transfer_timeout_s=1.0, layerwise=False)
    unusable = {}
    if reason == PEER_MISSING:
        unusable = {DECODE: "no NIXL record in etcd"}
        transport.peers = set()
    elif reason == BAD_TASK:
        task.sampling_params = {"temperature": float("nan")}
    elif reason == CANCELLED:
        batch.cancel([task.key])
    elif reason == BATCH_FAILED:
        def broken_step(**_):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        monkeypatch.setattr(eng, "step", broken_step)
    elif reason == REQUEST_FAILED:
        real = eng.step

        def failing_sampler(**kw):  # the engine fails this one request (its sampler raised)
            deltas = real(**kw)
            for d in deltas:
                d.finish_reason, d.error, d.new_token_ids = "error", "sampling raised", []
            return deltas
        monkeypatch.setattr(eng, "step", failing_sampler)
    result = batch.run([task], unusable)
    monkeypatch.undo()
    return result.failures, transport


# case -> (its notice's writes_settled, settled over the queue path where only the kind travels)
PREFILL_CASES = {
    PEER_MISSING: (True, True),  # nothing posted; no notice can reach the decode worker
    BAD_TASK: (True, True),
    CANCELLED: (True, True),
    BATCH_FAILED: (True, True),
    REQUEST_FAILED: (True, True),
    TRANSFER_ERROR: (True, False),  # the write failed: the worker knows; the queue path cannot tell
    "transfer_timeout": (False, False),  # a timed-out write may still land
}


@pytest.mark.parametrize("reason", sorted(PREFILL_CASES))
@pytest.mark.parametrize("path", ["notice", "queue"])
def test_a_prefill_failure_ends_both_sides_with_every_block_owned_once(engines, reason, path, monkeypatch):
    dec, pre = engines
    free_d, free_p = dec.kv.num_free_blocks, pre.kv.num_free_blocks
    handoffs = Handoffs(quarantine_s=60.0)
    rid = f"r-{reason}-{path}"
    task, reserved = decode_reserves(dec, handoffs, rid)
    assert dec.kv.num_free_blocks == free_d - len(reserved)

    failures, transport = prefill_fails(pre, task, reason, monkeypatch)

    # The prefill side: one failure of the expected kind, and its engine keeps no block.
    kind = TRANSFER_ERROR if reason == "transfer_timeout" else reason
    notice_settled, queue_settled = PREFILL_CASES[reason]
    assert [(f.kind, f.writes_settled) for f in failures] == [(kind, notice_settled)]
    assert pre.kv.num_free_blocks == free_p and not pre.has_work()
    # A notice goes out exactly when the transport reaches the decode worker.
    notices = [decode_notification(p) for p in transport.sent]
    assert len(notices) == (0 if reason == PEER_MISSING else 1)

    # The decode side learns it one way or the other.
    if path == "notice" and notices:
        msg = notices[0]
        assert (msg.request_id, msg.epoch, msg.kind) == (rid, 1, kind)
        assert msg.writes_settled is notice_settled
        step = handoffs.failed(rid, 1, msg.writes_settled, f"{msg.kind}: {msg.detail}")
        settled = notice_settled
    else:  # the prefill worker's `fail` on the queue: only the kind travels
        assert is_settled(kind) is queue_settled
        step = handoffs.failed(rid, 1, is_settled(kind), fallback_reason(kind, failures[0].detail))
        settled = queue_settled
    apply(step, dec)
    h = step.handoff
    assert h.reason.startswith(kind)
    if settled:  # no write can land: the blocks are back at once, the request prefills locally
        assert step.effect is Effect.FALL_BACK and h.state is HandoffState.FALLEN_BACK
        assert dec.kv.block_ids(h.quarantine_key) == []
        assert len(handoffs) == 0
    else:  # a write may still land: the reservation waits under the quarantine key
        assert step.effect is Effect.FALL_BACK_QUARANTINE and h.state is HandoffState.QUARANTINED
        assert dec.kv.block_ids(h.quarantine_key) == reserved
        # ... until the attempt's own notice says its writes are over
        late = handoffs.failed(rid, 1, True, "late PrefillFailed") if path == "notice" else handoffs.done(rid, 1)
        assert late.effect is Effect.FREE and late.handoff.state is HandoffState.RELEASED
        apply(late, dec)
        assert dec.kv.block_ids(h.quarantine_key) == [] and len(handoffs) == 0
    # The request itself is back on the local path; dropping it leaves the pool as it was.
    assert dec.abort_request(rid)
    assert dec.kv.num_free_blocks == free_d


@pytest.mark.parametrize("reason", sorted(k.name for k in FAILURES.values() if k.raised_by == QUEUE))
def test_a_queue_failure_frees_or_quarantines_as_the_table_says(engines, reason):
    """The queue's own reasons: nobody took the task (settled), or the prefill worker that held it
    was lost from view (not settled: it may still write, and its late PrefillDone frees the blocks)."""
    dec, _ = engines
    free_d = dec.kv.num_free_blocks
    handoffs = Handoffs(quarantine_s=60.0)
    rid = f"q-{reason}"
    task, reserved = decode_reserves(dec, handoffs, rid)
    step = handoffs.failed(rid, 1, is_settled(reason), fallback_reason(reason, "detail"))
    apply(step, dec)
    expected = {DEADLINE_EXPIRED: True, NO_LIVE_WORKER: True, WORKER_VANISHED: False, WORKER_STALLED: False,
                TARGET_GONE: False}[reason]
    assert is_settled(reason) is expected
    assert (step.handoff.state is HandoffState.FALLEN_BACK) is expected
    assert dec.kv.block_ids(step.handoff.quarantine_key) == ([] if expected else reserved)
    if not expected:  # the worker resumes: its late PrefillDone is a done for a quarantined attempt
        done = PrefillDone(rid, 1, 5, -0.1, task.num_prefill_tokens)
        assert handoffs.check_done(done.request_id, done.epoch, done.num_tokens_written) is None
        apply(handoffs.done(rid, 1), dec)
    assert dec.kv.block_ids(step.handoff.quarantine_key) == []
    assert dec.abort_request(rid)
    assert dec.kv.num_free_blocks == free_d


def test_the_success_path_ends_ready_on_decode_and_done_on_prefill(engines):
    dec, pre = engines
    free_d, free_p = dec.kv.num_free_blocks, pre.kv.num_free_blocks
    handoffs = Handoffs()
    task, reserved = decode_reserves(dec, handoffs, "ok-1")
    transport = ScriptedTransport("ok")
    batch = PrefillBatch(PREFILL, pre, transport, PrefillStats(), transfer_timeout_s=1.0, layerwise=False)
    jobs = []
    real_run = batch._compute

    def watch(js, result, *rest):  # keep the jobs to check their final state
        jobs.extend(js.values())
        return real_run(js, result, *rest)
    batch._compute = watch
    result = batch.run([task], {})
    assert result.done == 1 and result.failures == []
    assert [j.state for j in jobs] == [JobState.DONE]
    assert jobs[0].history == ["admitted --computed--> computed", "computed --posted--> posted",
                               "posted --written--> done"]
    assert pre.kv.num_free_blocks == free_p
    (msg,) = [decode_notification(p) for p in transport.sent]
    assert handoffs.check_done(msg.request_id, msg.epoch, msg.num_tokens_written) is None
    step = handoffs.done(msg.request_id, msg.epoch)
    apply(step, dec)
    assert step.handoff.state is HandoffState.READY and len(handoffs) == 0
    assert dec.kv.block_ids("ok-1")[: len(reserved)] == reserved  # the request runs in the blocks written
    assert dec.abort_request("ok-1")
    assert dec.kv.num_free_blocks == free_d


@pytest.mark.parametrize("as_computed", [True, False])
def test_a_prompt_done_in_an_earlier_step_is_written_and_announced_before_the_batch_ends(engines, as_computed):
    """Two prompts in one batch, the short one finished in the first step (256 tokens a step):
    its pages and PrefillDone go out after that step while the long one still computes
    (`push_as_computed`); without it, both go out after the batch."""
    dec, pre = engines
    free_d, free_p = dec.kv.num_free_blocks, pre.kv.num_free_blocks
    handoffs = Handoffs()
    base = 600 if as_computed else 1200  # prompts neither engine has cached (the engines serve every test here)
    short_prompt = list(range(base, base + 37))
    short, _ = decode_reserves(dec, handoffs, f"short-{as_computed}", short_prompt)
    long_prompt = [base + 50 + (i * 7) % 500 for i in range(300)]  # 300 tokens: two steps
    long, _ = decode_reserves(dec, handoffs, f"long-{as_computed}", long_prompt)
    transport = ScriptedTransport("ok")
    sent_at = {}  # request id -> prompt tokens the prefill engine had computed when its notice left
    real_write = transport.write_blocks

    def write_blocks(peer, local, remote, *, notify=None):
        sent_at[decode_notification(notify).request_id] = pre.stats.num_prompt_tokens_computed - before
        return real_write(peer, local, remote, notify=notify)
    transport.write_blocks = write_blocks
    batch = PrefillBatch(PREFILL, pre, transport, PrefillStats(), transfer_timeout_s=1.0, layerwise=False,
                         push_as_computed=as_computed)
    before = pre.stats.num_prompt_tokens_computed
    result = batch.run([short, long], {})
    assert result.done == 2 and result.failures == []
    total = len(short_prompt) + len(long_prompt)
    assert sent_at[long.request_id] == total
    if as_computed:
        assert sent_at[short.request_id] < total  # out while the long prompt was still computing
    else:
        assert sent_at[short.request_id] == total
    msgs = {m.request_id: m for m in (decode_notification(p) for p in transport.sent)}
    assert msgs[short.request_id].num_tokens_written == len(short_prompt)
    assert msgs[long.request_id].num_tokens_written == len(long_prompt)
    assert msgs[short.request_id].prefill_ms <= msgs[long.request_id].prefill_ms
    for task in (short, long):
        step = handoffs.done(task.request_id, 1)
        apply(step, dec)
        assert step.handoff.state is HandoffState.READY
        assert dec.abort_request(task.request_id)
    assert pre.kv.num_free_blocks == free_p and dec.kv.num_free_blocks == free_d


def test_a_superseded_attempt_writes_only_its_own_blocks_and_its_late_done_never_runs_the_request(engines):
    """Epochs are real: a task put again (the queue restarted) is the next attempt, epoch 2, with
    fresh blocks (`KVConnector.replace`); attempt 1's blocks wait in quarantine. A prefill worker
    that still held attempt 1 writes only those, and its PrefillDone frees them without running
    the request; attempt 2's PrefillDone runs it."""
    dec, pre = engines
    free_d, free_p = dec.kv.num_free_blocks, pre.kv.num_free_blocks
    handoffs = Handoffs(quarantine_s=60.0)
    rid = "epochs-1"
    task1, blocks1 = decode_reserves(dec, handoffs, rid)
    old = handoffs.awaited(rid)
    step = handoffs.supersede(rid, 1, "superseded: put again after a queue restart")
    assert step.effect is Effect.REPLACE and old.state is HandoffState.QUARANTINED
    res = dec.connector.replace(rid, old.quarantine_key)
    assert res is not None and not set(res.block_ids) & set(blocks1)  # two attempts never share a block
    assert dec.kv.block_ids(old.quarantine_key) == blocks1
    handoffs.reserve(rid, 2, len(res.block_ids))
    task2 = PrefillTask(rid, 2, PROMPT, res.cached_len, DECODE, res.block_ids, {"max_tokens": 4})
    assert not handoffs.queued(rid, 2, task2).stale

    def prefill(task):
        transport = ScriptedTransport("ok")
        batch = PrefillBatch(PREFILL, pre, transport, PrefillStats(), transfer_timeout_s=1.0, layerwise=False)
        assert not batch.run([task], {}).failures
        (done,) = [decode_notification(p) for p in transport.sent]
        return done

    late = prefill(task1)  # the lost queue's copy, computed by the worker that held it
    assert (late.request_id, late.epoch) == (rid, 1)
    assert handoffs.check_done(rid, 1, late.num_tokens_written) is None  # its own attempt: no forgery
    freed = handoffs.done(rid, 1)
    assert freed.effect is Effect.FREE  # ends the quarantine; the request still awaits attempt 2
    apply(freed, dec)
    assert dec.kv.block_ids(old.quarantine_key) == [] and handoffs.awaited(rid).epoch == 2
    assert dec.connector.is_awaiting(rid)
    done = prefill(task2)
    assert done.epoch == 2 and handoffs.check_done(rid, 2, done.num_tokens_written) is None
    ready = handoffs.done(rid, 2)
    assert ready.effect is Effect.RUN
    apply(ready, dec)
    assert not dec.connector.is_awaiting(rid) and len(handoffs) == 0
    # a second, stale notice of either attempt changes nothing
    assert handoffs.check_done(rid, 1, late.num_tokens_written) is not None and handoffs.done(rid, 1).stale
    assert dec.abort_request(rid)
    assert dec.kv.num_free_blocks == free_d and pre.kv.num_free_blocks == free_p


def test_a_superseded_attempt_with_no_room_for_fresh_blocks_prefills_locally(llama_dir):
    """No room for the next attempt's blocks: the request goes to a local prefill, the old
    attempt's blocks stay in quarantine."""
    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, num_gpu_blocks_override=4, max_num_batched_tokens=256,
                                             device="cpu"))
    handoffs = Handoffs()
    req = eng.make_request(PROMPT, SamplingParams(max_tokens=4), request_id="tight")
    res = eng.connector.reserve(req)
    assert res is not None and len(res.block_ids) == 3
    handoffs.reserve("tight", 1, 3)
    old = handoffs.awaited("tight")
    assert handoffs.supersede("tight", 1, "restart").effect is Effect.REPLACE
    assert eng.connector.replace("tight", old.quarantine_key) is None
    assert not eng.connector.is_awaiting("tight") and eng.has_work()  # queued for a local prefill
    assert eng.kv.block_ids(old.quarantine_key) == res.block_ids
    assert eng.abort_request("tight")
    eng.connector.free(old.quarantine_key)
    assert eng.kv.num_free_blocks == 4
