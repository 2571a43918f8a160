"""The engine's step loop in one owned thread, fed and read from asyncio.

The engine step is compute (tens of ms on CPU) and must not block the event
loop that serves gRPC and HTTP. So one thread, owned and joined by
`AsyncEngine`, is the only one that touches the `LLMEngine`: callers post
commands (add, abort, or any callable) to it, and it posts each request's
deltas back to that request's asyncio queue with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Callable

from pdserve.common import jsonlog
from pdserve.decode.final_info import FinalInfo, final_info
from pdserve.decode.spec_metrics import spec_outlook
from pdserve.engine import EngineLoad, KVConnector, LLMEngine, LoRARequest, RequestDelta, SamplingParams, StepError
from pdserve.engine.driver import EngineDriver, StepInfo

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the idle loop sleeps before re-checking pollers / stop
# A file to append one JSON line per engine step to (its time, size and the step plan's reason):
# for diagnosing the step plan on a live worker; unset (the default), nothing is written.
STEP_TRACE_ENV = "PDSERVE_STEP_TRACE"
# Failed steps in a row (each fails its own requests) before the engine is declared dead:
# one bad batch is that batch's problem, three in a row with different requests is the engine's.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The step loop crashed; in-flight requests were failed with this error."""


class AsyncEngine:
    """Owns the engine thread; the asyncio side submits requests and streams deltas.

    Failure containment, by whose failure it is:

    - one request's: its add, its abort, its sampling or detokenization, indexing its
      blocks for prefix reuse. It ends alone (finish_reason "error", blocks freed); the
      loop goes on. A failed step (forward pass) fails the requests in it.
    - a command or poller of another layer (the remote path's calls and pollers): logged,
      counted and skipped; the remote path turns its own failures into fallbacks.
    - the engine's own state: the scheduler (`EngineStateError`), an abort whose request
      cannot even be failed, `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row, or a
      bug in the loop itself. The thread stops: `alive` is False, every stream gets the
      error, and ``on_death(exc)`` runs on the event loop (the decode worker goes
      NOT_SERVING, leaves etcd and exits for its supervisor to restart it).

    Nothing ends the thread silently: every path out of it runs ``on_death``.
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[StepInfo], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self.on_death = on_death
        self.step_failures = 0  # in a row
        self.counters = {"failed_steps": 0, "failed_commands": 0, "failed_polls": 0}
        # Called in the engine thread each loop turn; return True if they did work (`start`).
        self._pollers: tuple[Callable[[], bool], ...] = ()
        self._after_schedule: tuple[Callable[[], object], ...] = ()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._held: set[str] = set()  # requests to add once their prefix loan ends (add_later)
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Idle sleep between loop turns; pollers shorten it while they await pages.
        self.idle_wait_s = IDLE_WAIT_S
        # One step at a time, as the prefill role steps too (engine/driver.py).
        self._driver = EngineDriver(engine, on_plan=[self._after_plan])
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        trace = os.environ.get(STEP_TRACE_ENV)
        self._trace = open(trace, "a", buffering=1 << 16) if trace else None

    # -- lifecycle -------------------------------------------------------------
    def start(self, pollers: Sequence[Callable[[], bool]] = (),
              after_schedule: Sequence[Callable[[], object]] = ()) -> None:
        """Start the engine thread; each loop turn it calls ``pollers`` (engine thread: the
        remote path's transport, decode/kv_arrival.py), which return whether they did work,
        and each step runs ``after_schedule`` once its plan is made, before its forward pass
        (the remote path takes the blocks that plan reserved, so its tasks go out while the
        step computes)."""
        self._pollers = tuple(pollers)
        self._after_schedule = tuple(after_schedule)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("engine thread did not stop within %.1f s", timeout_s)
        if self._trace is not None:
            self._trace.flush()

    @property
    def in_flight(self) -> tuple[float, int, int, int] | None:
        """The step under way, None between steps (EngineDriver; CostEstimates.step_left_ms)."""
        return self._driver.in_flight

    @property
    def thread_running(self) -> bool:
        """Whether the engine thread still runs (after `stop`: it did not stop in time)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- the engine as the event loop reads it ---------------------------------------------
    # Reads of the engine's own figures (one attribute or a short walk each, safe beside the
    # engine thread: they read, never change); everything that changes it goes through `call`.
    @property
    def connector(self) -> KVConnector:
        """The engine's remote-KV seam (engine/kv_connector.py); its changes belong in `call`."""
        return self.engine.connector

    @property
    def prompts(self):
        """The engine's tokenizer pool (what the APIs validate prompts with)."""
        return self.engine.prompts

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def load(self) -> EngineLoad:
        return self.engine.load()

    def spec_outlook(self, streams: int) -> tuple[int | None, float]:
        return spec_outlook(self.engine, streams)  # decode/spec_metrics.py

    def prompt_left(self, request_id: str) -> int | None:
        """Prompt tokens a started local prefill still has to compute (None: not started)."""
        return self.engine.prompt_left(request_id)

    def prompts_left(self, request_ids: list[str]) -> dict[str, int | None]:
        """`prompt_left` of each request."""
        return {rid: self.engine.prompt_left(rid) for rid in request_ids}

    def predicted_prefill_budget(self, tokens: int, cached: int, streams: int, backlog: int) -> int | None:
        """What the engine's step plan would give a prompt of ``tokens`` uncached tokens after
        ``cached`` ones, beside ``streams`` streams, behind ``backlog`` prompt tokens."""
        return self.engine.predicted_prefill_budget(tokens, cached, streams, backlog)

    def to_loop(self, fn: Callable, *args) -> None:
        """Engine thread: run ``fn(*args)`` on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def poll_briskly(self, brisk: bool) -> None:
        """Engine thread (a poller): while pages are awaited, the idle loop polls every
        millisecond instead of every `IDLE_WAIT_S`."""
        self.idle_wait_s = 0.001 if brisk else IDLE_WAIT_S

    # -- asyncio side ---------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               priority: int, tenant: str | None = None, resume_ids: list[int] | None = None,
               remote_kv: bool = False, lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """Queue a validated request; returns the queue its (delta, FinalInfo|None) items arrive on.
        `tenant`: whose it is (the scheduler's fair share among API keys); `resume_ids`: the
        tokens it already generated elsewhere (`LLMEngine.make_request`); `remote_kv`: another worker
        writes its prompt KV (decode/remote.py); `lora_request`: its LoRA adapter (None: the base)."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self._post(("add", request_id, prompt_ids, params, priority, tenant, resume_ids, remote_kv, lora_request))
        return q

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def post_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int,
                 tenant: str | None = None, resume_ids: list[int] | None = None,
                 lora: LoRARequest | None = None) -> None:
        """Queue a request whose deltas go where `_emit` and `_deliver_step` send them, with no
        stream of its own here (an engine-core process: decode/core_process.py)."""
        self._post(("add", request_id, prompt_ids, params, priority, tenant, resume_ids, False, lora))

    def set_step_targets(self, cost, targets) -> None:
        """The step plan's cost curve and SLOs (engine/step_plan.py), set on the engine thread."""
        self.call(lambda eng: eng.set_step_targets(cost, targets))

    def set_prefill_token_budget(self, tokens: int | None) -> None:
        """A fixed cap of prompt tokens per step (engine/step_plan.py), set on the engine thread."""
        self.call(lambda eng: eng.set_prefill_token_budget(tokens))

    def call(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run ``fn(engine)`` in the engine thread (for the remote-KV hooks)."""
        self._post(("call", fn))

    def attach(self, request_id: str) -> asyncio.Queue:
        """Register a stream for a request that enters the engine through `call`."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def detach(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _post(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                busy = self._drain_commands()
                for poll in self._pollers:
                    busy = self._guarded(poll, "failed_polls") or busy
                # Work that cannot be scheduled (the waiting head has no blocks and nothing
                # runs) waits like an idle loop for a command or a poller, never spins.
                stepped = self._step() if eng.has_work() else False
                # A step that only reserved blocks for remote KV computed nothing, but its
                # reservations are for the pollers to take now, not after an idle wait.
                if not stepped and not busy and not eng.connector.reservations_pending:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001  (fail every stream, then stop)
            log.critical("engine loop died: %s: %s", exc.__class__.__name__, exc, exc_info=exc)
            self.error = exc
            for rid in list(self._streams):
                self._emit(rid, exc, None)
            if self.on_death is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.on_death, exc)

    def _guarded(self, fn, counter: str, *args) -> bool:
        """Run a command or poller; one that raises is logged and counted, not fatal."""
        try:
            return bool(fn(*args))
        except Exception:  # noqa: BLE001
            self.counters[counter] += 1
            if self.counters[counter] <= 10 or self.counters[counter] % 1000 == 0:
                log.exception("engine thread: %s #%d", counter.replace("_", " "), self.counters[counter])
            return True

    def _drain_commands(self) -> bool:
        did = False
        eng = self.engine
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return did
            did = True
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort(cmd[1])
            elif kind == "call":
                self._guarded(cmd[1], "failed_commands", eng)

    def _add(self, rid: str, ids, params, priority, tenant, resume_ids=None, remote_kv=False, lora=None) -> None:
        try:
            self.engine.add_request(ids, params, request_id=rid, priority=priority, tenant=tenant,
                                    resume_ids=resume_ids, remote_kv=remote_kv, lora_request=lora)
        except Exception as exc:  # noqa: BLE001  (this request's error, not the engine's)
            self._emit(rid, exc, None)

    def add_later(self, request_id: str) -> None:
        """Engine thread: ``request_id`` (its stream attached) will be added by `add_held` once
        something it waits for is over (a prefix loan, decode/borrow.py); an abort meanwhile
        ends its stream and the later add is skipped."""
        self._held.add(request_id)

    def add_held(self, request_id: str, ids, params, priority, tenant) -> None:
        """Engine thread: add a request `add_later` announced, unless it was aborted since."""
        if request_id in self._held:
            self._held.discard(request_id)
            self._add(request_id, ids, params, priority, tenant)

    def _abort(self, rid: str) -> None:
        """Abort one request; if that raises, fail it (its error, its stream ends); if even
        that raises, the engine's state is broken (raised: the loop stops)."""
        eng = self.engine
        if rid in self._held:  # not in the engine yet (decode/borrow.py)
            self._held.discard(rid)
            self.deliver_abort(rid)
            return
        try:
            if eng.abort_request(rid):
                self.deliver_abort(rid)
            return
        except Exception as exc:  # noqa: BLE001
            self.counters["failed_commands"] += 1
            log.exception("engine thread: aborting request %s failed; failing it instead", rid, extra=jsonlog.about(rid))
            delta = eng.fail_request_id(rid, exc) or RequestDelta(
                rid, [], "", "error", error=f"abort failed: {exc.__class__.__name__}: {exc}")
            self._emit(rid, delta, None)

    def _step(self) -> bool:
        """One engine step; False if it scheduled nothing."""
        eng = self.engine
        try:
            deltas, info = self._driver.step()
        except StepError as exc:
            self._step_failed(exc)
            return True
        if info is None:
            return False
        self.step_failures = 0
        # One hand-over to the event loop per step, not one per stream: each
        # call_soon_threadsafe writes the loop's wake-up pipe (a syscall) and takes the GIL.
        if self._trace is not None:
            self._write_trace(info, eng)
        batch = [(d.request_id, d, self._final(d)) for d in deltas]
        if self._loop is not None and (batch or self.on_step is not None):
            self._loop.call_soon_threadsafe(self._deliver_step, batch, info)
        return True

    def _after_plan(self, _scheduled) -> None:
        """The step's plan is made, its forward pass not begun: the `after_schedule` hooks."""
        for hook in self._after_schedule:
            self._guarded(hook, "failed_polls")

    def _write_trace(self, info: "StepInfo", eng: LLMEngine) -> None:
        if self._trace is None:
            return
        self._trace.write(json.dumps({
            "end_s": round(info.end_s, 6), "ms": round(info.ms, 3),
            "prompt_tokens": info.prefill_tokens, "decodes": info.num_decode_seqs,
            **eng.step_plan()}) + "\n")

    def _deliver_step(self, batch: list, info: "StepInfo") -> None:
        """A step's deltas to their streams, then `on_step` (event loop)."""
        for rid, item, final in batch:
            q = self._streams.get(rid)
            if q is None:
                continue
            if final is not None or item.finished:
                self._finish_stream(rid, q, item, final)
            else:
                q.put_nowait((item, None))
        if self.on_step is not None:
            self.on_step(info)

    def _step_failed(self, exc: StepError) -> None:
        """Fail the step's requests with the error; the loop goes on unless it keeps failing."""
        self.step_failures += 1
        self.counters["failed_steps"] += 1
        log.error("%s (%d in a row); failing its %d requests", exc, self.step_failures, len(exc.request_ids),
                  exc_info=exc.cause)
        for rid in exc.request_ids:
            if self.engine.abort_request(rid):
                self._emit(rid, RequestDelta(rid, [], "", "error", error=str(exc)), None)
        if self.step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self.step_failures} engine steps failed in a row; last: {exc}") from exc

    def deliver_abort(self, request_id: str) -> None:
        """End an aborted request's stream with finish_reason "abort" (engine thread)."""
        log.debug("request %s aborted", request_id, extra=jsonlog.about(request_id))
        self._emit(request_id, RequestDelta(request_id, [], "", "abort"), None)

    def deliver(self, d: RequestDelta) -> None:
        """Send a delta to its stream (engine thread); finished requests are released."""
        self._emit(d.request_id, d, self._final(d))

    def _final(self, d: RequestDelta) -> "FinalInfo | None":
        """A finished request's figures (it is released from the engine here; engine thread)."""
        if not d.finished:
            return None
        out = self.engine.release(d.request_id)
        log.debug("request %s finished (%s)", d.request_id, d.finish_reason, extra=jsonlog.about(d.request_id))
        return final_info(out)

    def _emit(self, rid: str, item, final) -> None:
        q = self._streams.get(rid)
        if q is None or self._loop is None:
            return
        if final is not None or isinstance(item, BaseException) or getattr(item, "finished", False):
            self._loop.call_soon_threadsafe(self._finish_stream, rid, q, item, final)
        else:
            self._loop.call_soon_threadsafe(q.put_nowait, (item, None))

    def _finish_stream(self, rid: str, q: asyncio.Queue, item, final) -> None:
        q.put_nowait((item, final))
        if self._streams.get(rid) is q:
            del self._streams[rid]
