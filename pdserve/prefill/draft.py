"""A speculative draft model's (or head's) KV of the prompts a prefill batch computed, shipped
beside the target's (docs/speculative.md, "In the cluster"; ``speculative_config`` with
``draft_prompt_kv: prefill`` on both roles).

A task whose decode worker speculates with a draft model names the blocks of its draft's pool
that the prompt's draft KV goes to (``draft_block_ids``; a head's: engine/spec_eagle.py, its
rows and the carrier of the last one's hidden input). When this prefill worker runs the same
draft (its engine's `KVConnector.draft`) and the decode worker registered a draft pool of the
same layout (kvtransfer/nixl/pools.py), the batch computes the draft's KV of each such prompt
after the target's (a head's: along with it, step by step), writes it (rank 0 to rank 0) and waits for the write before the task's
`PrefillDone` leaves, which then says how many positions were written. Otherwise the task gets
none: its decode worker's draft computes the prompt itself. A write that failed costs that
request's proposals only (the target verifies every one); one that timed out and may still
land fails the request's handoff, as a target write's would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine import LLMEngine
from pdserve.kvtransfer import TRANSFER_ERROR, TransportError, WriteFailed, WriteTimedOut

from .values import PrefillStats

log = logging.getLogger(__name__)


def push_draft(engine: LLMEngine, sender: Any, jobs: list, timeout_s: float, stats: PrefillStats,
               before_wait: Callable[[], None]) -> dict[str, int]:
    """Compute and write the draft's KV of the computed ``jobs`` (prefill/batch.py `PrefillJob`)
    whose task wants it; the prompt positions written, by request id. Every wait shares one
    deadline (a dead decode worker holds the batch's other handoffs up by ``timeout_s`` at
    most). A write that timed out may still land: its job fails as a target write's would
    (``write_may_land``: the decode worker keeps the request's blocks, the draft's with them,
    quarantined). ``before_wait`` runs before each bounded piece of work (the batch's progress)."""
    connector = engine.connector
    draft = connector.draft
    write, has = getattr(sender, "write_pool", None), getattr(sender, "has_pool", None)
    if draft is None or write is None or has is None:  # (a sender of one pool only)
        return {}

    def wanted(job) -> bool:
        t = job.task
        if not t.draft_block_ids or len(t.draft_block_ids) != draft.prompt_blocks(len(t.token_ids)):
            return False  # (none asked, or a decode worker whose proposer takes the prompt otherwise)
        try:
            return has(t.target_worker_id, "draft")
        except TransportError:  # (the peer was removed meanwhile: its target write fails on its own)
            return False

    ok = [job for job in jobs if wanted(job)]
    if not ok:
        return {}
    try:
        before_wait()
        blocks = connector.export_draft([(job.rid, job.task.token_ids) for job in ok])
    except Exception:  # noqa: BLE001  (the draft's failure costs proposals, never the requests)
        log.exception("the draft model could not compute %d prompts for their decode workers", len(ok))
        return {}
    posted = []
    for job in ok:
        local, t = blocks.get(job.rid), job.task
        if local:
            try:
                posted.append((job, write(t.target_worker_id, "draft", local, t.draft_block_ids[:len(local)])))
            except (TransportError, ValueError) as exc:
                log.warning("request %s: the draft's KV was not written (%s)", job.rid, exc)
    out = {}
    deadline = time.monotonic() + timeout_s
    for job, handle in posted:
        try:
            before_wait()
            sender.wait(handle, max(deadline - time.monotonic(), 0.0))
        except WriteTimedOut as exc:
            stats.transfer_failures += 1
            job.handles = [handle]  # (what the batch's settling waits for once more)
            job.fail(TRANSFER_ERROR, f"the draft's KV write: {exc.__class__.__name__}: {exc}", write_may_land=True)
            continue
        except WriteFailed as exc:  # nothing of it lands: the decode worker's draft computes the prompt
            log.warning("request %s: the draft's KV was not written (%s)", job.rid, exc)
            continue
        out[job.rid] = len(job.task.token_ids)
        stats.bytes_written += handle.num_bytes
    return out
