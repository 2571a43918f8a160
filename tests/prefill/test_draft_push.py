"""prefill/draft.py: the draft model's prompt KV computed by a real engine and handed to a
sender whose faults are scripted (a peer gone before the write, a write that times out and may
still land, one that fails outright), as tests/handoff/test_both_sides.py scripts the
transport. The write itself over real NIXL agents: tests/e2e/test_spec_decode_pd.py."""

from __future__ import annotations

import pytest

from pdserve.engine import LLMEngine
from pdserve.engine.config import EngineConfig
from pdserve.kvtransfer import TRANSFER_ERROR, PrefillJob, PrefillTask
from pdserve.kvtransfer.nixl import TransferError, TransferTimeoutError, UnknownPeerError
from pdserve.prefill.draft import push_draft
from pdserve.prefill.values import PrefillStats


class Handle:
    num_bytes = 4096


class ScriptedSender:
    """``fault``: None, "gone" (has_pool raises), "timeout" or "failed" (the wait raises)."""

    def __init__(self, fault: str | None):
        self.fault = fault
        self.writes: list[tuple[str, list[int], list[int]]] = []

    def has_pool(self, peer: str, pool: str) -> bool:
        if self.fault == "gone":
            raise UnknownPeerError(f"unknown peer {peer!r}")
        return pool == "draft"

    def write_pool(self, peer: str, pool: str, local, remote) -> Handle:
        self.writes.append((pool, list(local), list(remote)))
        return Handle()

    def wait(self, handle, timeout_s: float):
        assert timeout_s <= 5.0  # (one deadline for the batch's draft writes)
        if self.fault == "timeout":
            raise TransferTimeoutError("did not complete")
        if self.fault == "failed":
            raise TransferError("peer closed")
        return handle


@pytest.fixture(scope="module")
def engine(llama_dir):
    spec = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 2, "draft_prompt_kv": "prefill"}
    eng = LLMEngine(EngineConfig.from_kwargs(llama_dir, speculative_config=spec))
    yield eng
    eng.close()


def computed_job(rid: str, n: int) -> PrefillJob:
    task = PrefillTask(rid, 1, list(range(3, 3 + n)), 0, "decode-0", [0] * (-(-n // 16)),
                       draft_block_ids=list(range(10, 10 + -(-n // 16))))
    job = PrefillJob(task, rid)
    job.computed(7, None)
    return job


@pytest.mark.parametrize("fault", [None, "gone", "timeout", "failed"])
def test_the_draft_push_survives_its_peers_faults(engine, fault):
    draft = engine.spec.draft
    jobs = [computed_job(f"{fault}-a", 40), computed_job(f"{fault}-b", 20)]
    sender, stats = ScriptedSender(fault), PrefillStats()
    marks = []
    written = push_draft(engine, sender, jobs, 5.0, stats, lambda: marks.append(1))
    for job in jobs:
        draft.kv.free(job.rid)  # (release_export's part, in the batch)
    assert draft.kv.num_free_blocks == draft.kv.pool.num_blocks
    if fault is None:  # both computed and written into the blocks their tasks name
        assert written == {"None-a": 40, "None-b": 20}
        assert [(w[0], len(w[1]), w[2]) for w in sender.writes] == [("draft", 3, [10, 11, 12]), ("draft", 2, [10, 11])]
        assert stats.bytes_written == 2 * Handle.num_bytes and all(j.failure is None for j in jobs)
    elif fault == "gone":  # the peer left: no draft KV, no exception, the target's write fails on its own
        assert written == {} and sender.writes == [] and all(j.failure is None for j in jobs)
    elif fault == "timeout":  # it may still land: the handoff fails as a target write's would
        assert written == {} and all(j.failure[0] == TRANSFER_ERROR and j.write_may_land for j in jobs)
        assert stats.transfer_failures == 2
    else:  # nothing lands: the decode worker's draft computes the prompts
        assert written == {} and all(j.failure is None for j in jobs)
    assert bool(marks) == (fault != "gone")  # the batch's progress marked before the draft's work
