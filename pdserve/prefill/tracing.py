"""A prefill worker's spans of the tasks it ran (common/tracing.py; docs/cluster.md, "Tracing").

Each task whose decode worker traces its request carries that request span's traceparent
(kvtransfer/task.py); after its batch, the task's spans are made from the times its
`PrefillJob` noted at each event (kvtransfer/prefill_side.py), as children of that span:
``queue.wait`` (put by the decode worker -> admitted here), ``prefill.task`` (kind consumer:
admitted -> written or failed), and under it ``prefill.compute`` (admitted -> its first token)
and ``kv.write`` (its pages posted -> every write landed, with the bytes). A task without a
traceparent, or a worker that does not trace, makes none.

Log lines about a task on the batch thread (the engine's too, by the id it runs under) name
its request and trace (`track_task`, `task_log_ids`; common/jsonlog.py).
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.common import jsonlog, tracing
from pdserve.kvtransfer.prefill_side import PrefillJob
from pdserve.kvtransfer.task import PrefillTask

from .values import BatchResult


def _ns(t: float) -> int:
    return int(t * 1e9)


def _task_attrs(task: PrefillTask, worker_id: str) -> dict[str, Any]:
    return {"pdserve.worker_id": worker_id, "pdserve.request_id": task.request_id, "pdserve.attempt": task.epoch,
            "pdserve.prompt_tokens": len(task.token_ids), "pdserve.cached_tokens": task.cached_len,
            "pdserve.target_worker": task.target_worker_id, "pdserve.priority": task.priority.label}


def task_log_ids(task: PrefillTask) -> dict[str, str]:
    """The ``extra`` of a log line about ``task``: its request id, and its trace id when its
    decode worker traces the request."""
    trace_id = tracing.trace_id_of({tracing.TRACEPARENT: task.traceparent}) if task.traceparent else None
    return {"request_id": task.request_id, **({"trace_id": trace_id} if trace_id else {})}


def track_task(engine_id: str, task: PrefillTask) -> None:
    """The engine runs ``task`` as ``engine_id``: its lines about it name the task's ids
    (`jsonlog.untrack` once the batch is over)."""
    ids = task_log_ids(task)
    jsonlog.track(engine_id, ids["request_id"], ids.get("trace_id"))


def trace_batch(result: BatchResult, worker_id: str) -> BatchResult:
    """The spans of a batch's tasks (none when this worker does not trace); returns ``result``."""
    tr = tracing.tracer("prefill")
    if not tr.enabled:
        return result
    admitted = set()
    for job in result.jobs:
        admitted.add(id(job.task))
        if job.task.traceparent:
            _job_spans(tr, job, worker_id, result)
    now = time.time()
    for f in result.failures:  # refused before admission: no engine work, only the failure
        t = f.task
        if id(t) not in admitted and t.traceparent:
            tr.record("queue.wait", t.traceparent, _ns(t.arrival_time), _ns(now), {"pdserve.priority": t.priority.label})
            span = tr.start("prefill.task", t.traceparent, start_ns=_ns(now), kind="consumer",
                            attrs={**_task_attrs(t, worker_id), "pdserve.failure": f.kind})
            span.fail(f"{f.kind}: {f.detail}")
            span.end(_ns(now))
    return result


def _job_spans(tr: Any, job: PrefillJob, worker_id: str, result: BatchResult) -> None:
    task, at = job.task, job.times
    start = at["admitted"]
    end = at.get("written", at.get("fail", time.time()))
    tr.record("queue.wait", task.traceparent, _ns(task.arrival_time), _ns(start), {
        "pdserve.queue_wait_ms": max(0.0, (start - task.arrival_time) * 1e3), "pdserve.priority": task.priority.label,
        "pdserve.attempt": task.epoch, "pdserve.prefix_hint": bool(task.prefix_hint)})
    span = tr.start("prefill.task", task.traceparent, start_ns=_ns(start), kind="consumer", attrs={
        **_task_attrs(task, worker_id), "pdserve.batch_tokens": result.batch_tokens,
        "pdserve.batch_tasks": result.num_tasks, "pdserve.state": job.state.value})
    if "computed" in at:
        span.record("prefill.compute", _ns(start), _ns(at["computed"]), {
            "pdserve.prefill_tokens": task.num_prefill_tokens, "pdserve.batch_tokens": result.batch_tokens})
    began = at.get("stream", at.get("posted"))  # layer by layer: from the first layer's post
    if began is not None and "written" in at:
        span.record("kv.write", _ns(began), _ns(at["written"]), {
            "pdserve.transfer_bytes": sum(getattr(h, "num_bytes", 0) for h in job.handles),
            "pdserve.layerwise": "stream" in at, "pdserve.target_worker": task.target_worker_id})
    if job.failure is not None:
        span.set({"pdserve.failure": job.failure[0]})
        span.fail(f"{job.failure[0]}: {job.failure[1]}")
    span.end(_ns(end))
