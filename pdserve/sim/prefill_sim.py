"""A simulated prefill worker (`PrefillSim`): takes batches from the product's prefill queue,
computes them on the simulation's clock and pushes each task's KV as prefill/batch.py does
(``push_as_computed``): a request's KV transfer starts when the engine step its prefill ends in
is over, not when the batch's last step is; and as there, the batch goes on (its next step, or
its next batch) only once the writes it posted are over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvtransfer.task import PrefillTask

from .engine import StepInfo, worker_engine
from .profile import StepModel

if TYPE_CHECKING:
    from .cluster import Simulation

# An idle prefill worker's long poll (prefill/worker.py poll_timeout_ms): a put wakes it at once,
# and without one it takes again after this long (a task the queue kept for the worker holding
# its prefix, cluster/queue/core.py `_keep_for_prefix`, is handed to another at such a take).
POLL_TIMEOUT_S = 1.0


class PrefillSim:
    """A prefill worker: takes batches from the queue, computes them, sends each task's KV after
    the step its prefill ends in (prefill/batch.py)."""

    def __init__(self, sim: Simulation, wid: str, model: StepModel) -> None:
        self.sim, self.wid = sim, wid
        prof = sim.prefill_profile
        self.engine = worker_engine(model, prof, sim.topology.prefill_tp, clock=lambda: sim.now, rng=sim.rng,
                                    shared_load=sim.stream_load)
        self.jobs: dict[str, PrefillTask] = {}
        self.idle = True
        self.draining = False
        self.started_at: float = sim.now
        self.ended_at: float | None = None
        self.tasks = 0
        self.batch_started = 0.0
        self._computed_before = 0  # the engine's prompt tokens computed when the batch started
        self._repoll_at: float | None = None
        # Each task's KV: (the step its prefill ended in, when its write landed), for tests and reports.
        self.pushed: dict[str, tuple[float, float]] = {}

    def poll(self) -> None:
        """get_batch: the next batch (prefill/worker.py), or idle until a put wakes it."""
        sim = self.sim
        if self.draining:
            self.idle = True
            return
        sim.beat()
        batch = sim.queue.take(self.wid, sim.prefill_profile.prefill_batch_tokens)
        if not batch:
            self.idle = True
            if len(sim.queue) and self._repoll_at is None:
                # what is queued was kept for another worker (prefix-aware dispatch): the long
                # poll takes again when it times out
                self._repoll_at = sim.now + POLL_TIMEOUT_S
                sim.at(self._repoll_at, self._repoll)
            return
        self.idle = False
        sim.at(sim.now + sim.prefill_profile.queue_hop_ms / 1e3, self._start, batch)

    def _repoll(self) -> None:
        self._repoll_at = None
        if self.idle and not self.draining:
            self.poll()

    def _start(self, batch: list[PrefillTask]) -> None:
        now = self.sim.now
        self.batch_started = now
        self._computed_before = self.engine.prompt_tokens_computed
        for t in batch:
            req = self.engine.request(t.request_id, t.token_ids, 1, t.priority, now)
            self.engine.scheduler.add(req)
            self.jobs[t.request_id] = t
        self._step()

    def _step(self) -> None:
        out, info = self.engine.plan()
        if info is None:
            at = self.engine.next_load_at()
            if at is None:
                raise RuntimeError(f"{self.wid}: a batch that cannot be scheduled (its prompt exceeds the KV pool)")
            self.sim.at(max(at, self.sim.now), self._step)  # only tier loads to wait for
            return
        self.sim.at(self.sim.now + info.ms / 1e3, self._stepped, out, info)

    def _stepped(self, out: SchedulerOutput, info: StepInfo) -> None:
        sim = self.sim
        emitted = self.engine.commit(out, info)
        sim.queue.alive(self.wid)  # the worker's heartbeat carries its compute progress
        # prefill/batch.py push_as_computed: the tasks whose prefill ended in this step are
        # written and announced now, while the batch's other prompts go on. Their PrefillDone
        # reports the batch's time and the tokens it computed so far.
        done = [self.jobs[req.request_id] for req, _ in emitted if req.request_id in self.jobs]
        wait_ms = self._push(done) if done else 0.0
        # prefill/batch.py _push waits for the writes it posted before the batch goes on: its next
        # step, or (the batch over) the worker's next batch
        nxt = self._step if self.engine.has_work() else self._batch_over
        if wait_ms > 0:
            sim.at(sim.now + wait_ms / 1e3, nxt)
        else:
            nxt()

    def _push(self, done: list[PrefillTask]) -> float:
        """Send each task's KV to its decode worker; returns the longest write (ms)."""
        sim, prof = self.sim, self.sim.prefill_profile
        compute_ms = (sim.now - self.batch_started) * 1e3
        batch_tokens = self.engine.prompt_tokens_computed - self._computed_before
        target = {d.wid: d for d in sim.decode}
        longest = 0.0
        for t in done:
            tokens = len(t.token_ids) - t.cached_len
            tr = prof.transfer_ms(tokens, compute_ms)
            sim.at(sim.now + tr / 1e3, target[t.target_worker_id].kv_arrived, t, batch_tokens, compute_ms, tr)
            self.pushed[t.request_id] = (sim.now, sim.now + tr / 1e3)
            longest = max(longest, tr)
        return longest

    def _batch_over(self) -> None:
        self.sim.queue.complete(self.wid, list(self.jobs))
        self.tasks += len(self.jobs)
        self.jobs = {}
        if not self.draining:
            self.poll()
        else:
            self.idle = True

    def load_record(self) -> dict:
        eng = self.engine
        return {"t": self.sim.now, "busy_s": eng.busy_ms / 1e3, "kv_usage": eng.kv.usage,
                "tokens": eng.prompt_tokens_computed, "tasks": self.tasks, "inflight": len(self.jobs)}
