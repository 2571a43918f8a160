"""One prefill batch, run in the worker thread: admit, compute, push pages, report each task.

A task's pages are written and its `PrefillDone` sent after the engine step its prefill ends
in, while the batch's other prompts go on computing (`push_as_computed`): a batch that takes
several steps does not hold every first token until its last one.

Every task of a batch ends in exactly one of two ways: its pages are written
and a `PrefillDone` rides behind them, or it fails and its decode worker is
told at once with a `PrefillFailed` notice (kvtransfer/notices.py) so that it
prefills locally instead of waiting out its remote deadline. A failure stays
with its task where it can: a bad task, a request the sampler fails, or a
page write that fails ends that task only; a forward pass that raises (OOM,
device error) fails the tasks of its batch, whose engine state is then
aborted and freed so the next batch starts clean. Each task is a `PrefillJob`
(kvtransfer/prefill_side.py: its states and the one table that moves them).

A `PrefillFailed` is sent only once no page write of that attempt can still
land (posted writes are waited for; `writes_settled` says if one timed out),
so the decode worker may hand the reserved blocks to another request at once.
It goes over the transport's notification channel (a `KVSender`,
kvtransfer/transport.py; NIXL in production) when this worker has one to the
target; the worker's loop (asyncio side) also fails the task back through
the queue (`PrefillQueue.fail`), which reaches the decode worker's failed-task
poll even when NIXL cannot (no peer metadata, a broken connection).

The batch marks the compute thread's progress as it goes (`progress`, the worker's
`ComputeProgress`): every engine step, every write waited for, each with how long the next
may take (prefill/progress.py: a multiple of its predicted slowest step, or the wait's own
timeout). The worker's heartbeat carries it, so the queue can tell a batch that is slow from
a thread that is hung (cluster/queue/liveness.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from pdserve.common import jsonlog
from pdserve.common.compute_thread import ComputeProgress
from pdserve.engine import LLMEngine
from pdserve.engine.driver import EngineDriver
from pdserve.kvtransfer import (
    BAD_TASK,
    BATCH_FAILED,
    CANCELLED,
    PEER_MISSING,
    REQUEST_FAILED,
    TRANSFER_ERROR,
    JobState,
    KVSender,
    PrefillDone,
    PrefillFailed,
    PrefillJob,
    TransportError,
    WriteFailed,
    WriteTimedOut,
)
from pdserve.kvtransfer.task import PrefillTask
from pdserve.router.costs import CostModel

from .admit import TaskAdmission
from .draft import push_draft
from .progress import UNTIMED_STEP_S, UNTIMED_STEP_S_GPU, WAIT_SLACK_S, StepTimes
from .tracing import task_log_ids, track_task
from .values import BatchResult, PrefillStats, TaskFailure

log = logging.getLogger(__name__)

MAX_CANCELLED_REMEMBERED = 10_000
MAX_STEPS_PER_BATCH = 100_000  # each step computes at least one token: a bound, not a budget
# NIXL runs without its progress thread: a bare notification leaves only while someone drives
# the agent. Drive it this long after sending PrefillFailed notices (the queue path backs it up).
NOTICE_FLUSH_S = 0.02


class PrefillBatch:
    """Runs batches on one engine and one transport (both owned by the worker thread).

    ``poll`` drives the transport (default: the agent's own `poll`; a lending worker's answers
    the loan requests first, prefill/loans.py), and ``between_steps`` runs after every step of
    a batch (a lending worker answers the loan requests there, so a borrower waits a step, not
    a batch)."""

    def __init__(self, worker_id: str, engine: LLMEngine, agent: KVSender, stats: PrefillStats, *,
                 transfer_timeout_s: float, layerwise: bool, push_as_computed: bool = True,
                 progress: ComputeProgress | None = None, costs: CostModel | None = None,
                 poll: Callable[[], object] | None = None, between_steps: Callable[[], None] | None = None):
        self.worker_id = worker_id
        self.engine = engine
        self.agent = agent
        self.stats = stats
        self.transfer_timeout_s = transfer_timeout_s
        self.layerwise = layerwise
        # A request whose prefill ends in a step is written and announced after that step, not
        # after the batch's last: a batch of several prompts in several steps no longer gives
        # each the batch's time to first token (False: every request after the batch, as before).
        self.push_as_computed = push_as_computed
        # (request_id, epoch) of held tasks their decode worker aborted (the queue's heartbeat
        # answer, set from the event loop): computed no further, see `_drop_cancelled`.
        self._cancelled: set[tuple[str, int]] = set()
        self._cancel_lock = threading.Lock()
        self.poll = poll if poll is not None else agent.poll
        self.between_steps = between_steps
        # The compute thread's progress, which the worker's heartbeat carries to the queue (None:
        # not tracked), and the steps timed so far, which predict how long the next may take.
        self.progress = progress
        on_gpu = getattr(getattr(getattr(engine, "runner", None), "device", None), "type", "cpu") == "cuda"
        self.step_times = StepTimes(untimed_s=UNTIMED_STEP_S_GPU if on_gpu else UNTIMED_STEP_S)
        self._allowance_s = 0.0  # how long a step of the batch under way may take (`run`)
        # router/costs.py CostModel fed with every step (the worker's borrow decisions), or None
        self.costs = costs
        self.admission = TaskAdmission(engine)  # tasks into the engine, their LoRA adapters (prefill/admit.py)

    def cancel(self, keys: Iterable[tuple[str, int]]) -> None:
        """Stop computing these tasks (request_id, epoch) at the next step (any thread)."""
        with self._cancel_lock:
            self._cancelled.update(keys)
            if len(self._cancelled) > MAX_CANCELLED_REMEMBERED:  # keys of batches long over
                self._cancelled = set(list(self._cancelled)[-MAX_CANCELLED_REMEMBERED // 2:])

    def _drop_cancelled(self, jobs: dict[str, PrefillJob]) -> None:
        """Fail the unfinished jobs whose task was cancelled: their engine request is aborted
        (its blocks freed), no further page is posted, and the PrefillFailed notice (sent once
        every posted write is over) tells the decode worker its quarantined blocks are free."""
        with self._cancel_lock:
            if not self._cancelled:
                return
            hit = [job for job in jobs.values() if job.key in self._cancelled]
        for job in hit:
            computing = job.state.computing
            if job.fail(CANCELLED, "its decode worker aborted the request while it was computed") and computing:
                self.engine.abort_request(job.rid)

    def run(self, tasks: list[PrefillTask], unusable: dict[str, str]) -> BatchResult:
        """Prefill `tasks`; `unusable` maps target worker ids this worker cannot reach to why."""
        eng = self.engine
        result = BatchResult(num_tasks=len(tasks))
        taken_at = time.time()
        # From here the thread answers for its progress by the batch's slowest step, predicted.
        self._allowance_s = self.step_times.allowance(tasks, eng.config.max_num_batched_tokens)
        self._mark(self._allowance_s)
        jobs: dict[str, PrefillJob] = {}
        failures: list[TaskFailure] = []
        for t in tasks:
            if t.target_worker_id in unusable:
                failures.append(TaskFailure(t, PEER_MISSING, unusable[t.target_worker_id]))
                continue
            try:
                rid = self._admit(t)
            except Exception as exc:  # noqa: BLE001  (InvalidRequestError, TypeError: the task is bad)
                failures.append(TaskFailure(t, BAD_TASK, f"{exc.__class__.__name__}: {exc}"))
                continue
            jobs[rid] = PrefillJob(t, rid)
            track_task(rid, t)  # the engine's lines about it name its request and trace
        settled: dict[str, bool] = {}
        try:
            if jobs:
                self._compute(jobs, result, taken_at)
                self._push(jobs, result, taken_at)
        finally:
            for job in jobs.values():
                if job.failure is not None:  # before its blocks are freed: its writes read them
                    settled[job.rid] = self._settle(job)
            for job in jobs.values():  # success or failure, the batch leaves nothing behind
                eng.connector.release_export(job.rid)
                jsonlog.untrack(job.rid)
            with self._cancel_lock:
                self._cancelled.difference_update(job.key for job in jobs.values())
        for job in jobs.values():
            if job.failure is not None:
                failures.append(TaskFailure(job.task, *job.failure, writes_settled=settled[job.rid]))
        for f in failures:
            self._notify(f)
        self._progress(NOTICE_FLUSH_S if any(f.notified for f in failures) else 0.0)
        self.admission.refresh()  # the adapters held now (the record's load["lora_adapters"])
        self.stats.batches += 1
        self.stats.tasks_done += result.done
        result.failures, result.jobs = failures, list(jobs.values())
        return result

    # -- admit ---------------------------------------------------------------------------
    def _admit(self, t: PrefillTask) -> str:
        return self.admission.admit(t)  # prefill/admit.py: its first token's sampling, its adapter

    # -- compute ---------------------------------------------------------------------------
    def _compute(self, jobs: dict[str, PrefillJob], result: BatchResult, taken_at: float) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        computed_before = eng.stats.num_prompt_tokens_computed
        # The batch's steps, driven as a decode worker's engine thread drives its own
        # (engine/driver.py); the hook streams the pages of prompts that finish in a step.
        driver = EngineDriver(eng, on_plan=[self._layer_hook_factory(jobs)] if self.layerwise else [])
        for _ in range(MAX_STEPS_PER_BATCH):
            self._drop_cancelled(jobs)
            if not any(job.state.computing for job in jobs.values()):
                break
            try:
                deltas, info = driver.step()
            except Exception as exc:  # noqa: BLE001  (StepError: the forward pass raised)
                self._fail_batch(jobs, f"{exc.__class__.__name__}: {exc}")
                break
            if info is not None:
                self.step_times.observe(info.ms / 1e3, info.prefill_tokens, info.prefill_pairs)
                if self.costs is not None and info.prefill_tokens > 0:
                    self.costs.observe_step(info.ms, info.num_decode_seqs, info.prefill_tokens, info.prefill_pairs)
            self._mark(self._allowance_s)  # a step done: the next is due within the batch's allowance
            if self.between_steps is not None:
                self.between_steps()  # e.g. answer other workers' loan requests within a step
            if not deltas and not eng.has_work():
                self._fail_batch(jobs, "the engine has nothing left to schedule for this batch")
                break
            for d in deltas:
                job = jobs.get(d.request_id)
                if job is None or not job.state.computing:
                    continue
                if d.finish_reason == "error":
                    job.fail(REQUEST_FAILED, d.error or "the engine failed this request")
                elif d.new_token_ids:
                    lp = d.logprobs[0] if d.logprobs else {}
                    job.computed(d.new_token_ids[0], lp.get("logprob"), tuple(lp.get("top_logprobs", {}).items()))
            ready = {rid: job for rid, job in jobs.items() if job.state is JobState.COMPUTED}
            if self.push_as_computed and ready and any(job.state.computing for job in jobs.values()):
                # Requests finished in this step while others go on: write and announce them now.
                # Their PrefillDone reports the time and the tokens computed so far.
                result.prefill_ms = (time.perf_counter() - t0) * 1e3
                result.batch_tokens = eng.stats.num_prompt_tokens_computed - computed_before
                self._push(ready, result, taken_at)
        else:
            self._fail_batch(jobs, f"not prefilled within {MAX_STEPS_PER_BATCH} engine steps")
        result.prefill_ms = (time.perf_counter() - t0) * 1e3
        result.batch_tokens = eng.stats.num_prompt_tokens_computed - computed_before

    def _fail_batch(self, jobs: dict[str, PrefillJob], detail: str) -> None:
        """The step failed: its requests are in an undefined state. Abort every unsettled one
        (its blocks are freed with it); the engine itself goes on with the next batch."""
        log.error("prefill batch failed (%d tasks): %s", len(jobs), detail)
        self.stats.batches_failed += 1
        for job in jobs.values():
            if job.state.computing:
                job.fail(BATCH_FAILED, detail)
                self.engine.abort_request(job.rid)

    def _layer_hook_factory(self, jobs: dict[str, PrefillJob]):
        """on_plan callback: stream the pages of requests whose prefill ends in this step."""

        connector = self.engine.connector

        def on_plan(scheduled):
            jobs_now = []
            for rid in connector.finishing(scheduled):
                job = jobs.get(rid)
                if job is None or job.failure is not None:
                    continue
                t = job.task
                local = connector.export_blocks(rid, t.cached_len, len(t.target_block_ids))
                try:
                    job.streaming(self.agent.begin_stream(t.target_worker_id, local, t.target_block_ids, None))
                except TransportError as exc:  # the peer was removed meanwhile
                    job.fail(TRANSFER_ERROR, f"{exc.__class__.__name__}: {exc}")
                    continue
                except ValueError as exc:  # the target blocks do not fit the peer's pool
                    job.fail(BAD_TASK, f"{exc}")
                    continue
                jobs_now.append(job)
            if not jobs_now:
                return None

            def after_layer(layer: int, ready) -> None:
                # `ready`: the layer's pages are final once it says so (a CUDA event on a
                # GPU); the stream posts the write only then (kvtransfer/nixl/poster.py).
                for job in jobs_now:
                    if job.failure is None:
                        try:
                            job.stream.write_layer(layer, ready)
                        except Exception as exc:  # noqa: BLE001  (this request fails; the batch goes on)
                            self.stats.transfer_failures += 1
                            job.fail(TRANSFER_ERROR, f"{exc.__class__.__name__}: {exc}")

            return after_layer

        return on_plan

    # -- push ----------------------------------------------------------------------------------
    def _push(self, jobs: dict[str, PrefillJob], result: BatchResult, taken_at: float) -> None:
        connector = self.engine.connector
        self._drop_cancelled(jobs)  # (a whole-request write not yet posted is not posted at all)
        # The draft model's prompt KV first (prefill/draft.py): the PrefillDone says what was written.
        drafted = push_draft(self.engine, self.agent, [j for j in jobs.values() if j.state is JobState.COMPUTED],
                             self.transfer_timeout_s, self.stats, self._mark_wait)
        pending = []
        for job in jobs.values():
            if job.state is not JobState.COMPUTED:
                continue
            t = job.task
            assert job.first is not None  # (COMPUTED: the first token is known)
            tok, lp, top = job.first
            done = PrefillDone(t.request_id, t.epoch, tok, lp, t.num_prefill_tokens, first_top_logprobs=top,
                               queue_wait_ms=max(0.0, (taken_at - t.arrival_time) * 1e3),
                               prefill_ms=result.prefill_ms, prefill_worker=self.worker_id,
                               batch_tokens=result.batch_tokens, sent_at=time.time(), lora_name=t.lora_name,
                               lora_int_id=t.lora_int_id, lora_load_ms=self.admission.load_ms(job.rid),
                               draft_tokens=drafted.get(job.rid, 0)).encode()
            try:
                if job.stream is not None:
                    self._mark_wait()
                    job.stream.finish(self.transfer_timeout_s, notify=done)  # waits the layers, then notifies
                    job.posted(job.stream.handles.values())
                    self.stats.layerwise_tasks += 1
                else:
                    # Whole-request write after the step: its pages are final, the step's first
                    # token was copied to the host, which waited for every kernel of the stream.
                    local = connector.export_blocks(job.rid, t.cached_len, len(t.target_block_ids))
                    job.posted([self.agent.write_blocks(t.target_worker_id, local, t.target_block_ids,
                                                        notify=done)])
                pending.append(job)
            except (TransportError, ValueError) as exc:
                self.stats.transfer_failures += 1
                job.fail(TRANSFER_ERROR, f"{exc.__class__.__name__}: {exc}",
                         write_may_land=isinstance(exc, WriteTimedOut))
        for job in pending:
            try:
                for h in job.handles:
                    self._mark_wait()
                    self.agent.wait(h, self.transfer_timeout_s)
            except WriteFailed as exc:
                self.stats.transfer_failures += 1
                job.fail(TRANSFER_ERROR, f"{exc.__class__.__name__}: {exc}",
                         write_may_land=isinstance(exc, WriteTimedOut))
                continue
            job.written()
            self.stats.bytes_written += sum(h.num_bytes for h in job.handles)
            self.stats.tokens_computed += job.task.num_prefill_tokens
            result.done += 1
        self._mark(self._allowance_s)  # back to the batch's steps

    def _settle(self, job: PrefillJob) -> bool:
        """Wait until no posted write of a failed job can land; False if one may still (timed out)."""
        settled = not job.write_may_land
        self._mark_wait()
        if job.stream is not None:
            # Layers still waiting for their KV are dropped; one being posted right now is
            # waited for, so that every write that can land is among the handles below.
            job.stream.abort()
            settled = job.stream.settle_posts(self.transfer_timeout_s) and settled
        handles = list(job.stream.handles.values()) if job.stream is not None else job.handles
        for h in handles:
            if h.finished:
                continue
            self._mark_wait()
            try:
                self.agent.wait(h, self.transfer_timeout_s)
            except WriteTimedOut:
                settled = False
            except WriteFailed:
                pass  # failed: nothing more of it lands
        return settled

    def _mark(self, within_s: float | None = None) -> None:
        """Progress (compute thread): a unit of the batch is done, the next due within `within_s`."""
        if self.progress is not None:
            self.progress.mark(within_s)

    def _mark_wait(self) -> None:
        """A wait bounded by the transfer timeout comes next: it is due within that, and a little."""
        self._mark(self.transfer_timeout_s + WAIT_SLACK_S)

    def _progress(self, for_s: float) -> None:
        """Drive the agent (sends go out) and drop the finished handles it keeps for `poll()`."""
        until = time.monotonic() + for_s
        while True:
            try:
                self.poll()
            except TransportError as exc:
                log.warning("transport progress failed: %s", exc)
                return
            if time.monotonic() >= until:
                return
            time.sleep(0.001)

    # -- failure notices ---------------------------------------------------------------------------
    def _notify(self, f: TaskFailure) -> None:
        t = f.task
        self.stats.tasks_failed += 1
        self.stats.failed_by_kind[f.kind] += 1
        log.warning("prefill of %s (epoch %s) for %s failed [%s]: %s", t.request_id, t.epoch,
                    t.target_worker_id, f.kind, f.detail, extra=task_log_ids(t))
        if t.target_worker_id not in self.agent.peers:
            return  # no transport channel: the queue's failed-task path carries it
        try:
            msg = PrefillFailed(t.request_id, t.epoch, f.kind, f.detail, self.worker_id, f.writes_settled)
            self.agent.send_notification(t.target_worker_id, msg.encode())
            f.notified = True
            self.stats.failure_notices_sent += 1
        except (TransportError, ValueError) as exc:
            log.warning("could not send PrefillFailed for %s over the transport (%s); the queue carries it",
                        t.request_id, exc)
