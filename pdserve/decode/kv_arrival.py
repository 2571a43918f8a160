"""The engine-thread half of the remote path: pages arrive, handoffs move, the engine follows.

`KVArrival` runs as a poller of the decode worker's engine loop. It drives
the transport (a `KVReceiver`, kvtransfer/transport.py; NIXL in production),
reads each notice (`PrefillDone`, `PrefillFailed`), feeds it to the
worker's `Handoffs` table and applies the effect the table decides through
the engine's KV connector: run the request from its first token, fall back
to a local prefill, abort, or free a quarantine. It also
expires quarantines and applies what the event-loop side decided
(`apply`, posted with `AsyncEngine.call`). Engine state changes here only.

A `PrefillDone` this worker did not ask for (no live attempt with that
request id and epoch, or a token count other than the task it signed) is
refused before it touches anything, and counted
(`pdserve_remote_notifications_refused_total{reason}`, counter `refused_done`).
Pages computed under another LoRA adapter than the task's (`check_adapter`) are refused the
same way (reason ``wrong_adapter``), and the request prefills locally at once.
NIXL notifications are not authenticated: this catches confusion and stray
notices, not an attacker on the data-plane network (docs/security.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdserve.common import jsonlog
from pdserve.kvtransfer import (
    TRANSFER_ERROR,
    Effect,
    Handoff,
    Handoffs,
    KVReceiver,
    MalformedNoticeError,
    PrefillDone,
    PrefillFailed,
    Step,
    decode_notification,
)

from pdserve.engine import Reservation
from pdserve.kvtransfer.decode_side import AdapterMismatchError, check_adapter

from .async_engine import AsyncEngine
from .metrics import WorkerMetrics

if TYPE_CHECKING:
    from .borrow import PeerPrefixes
    from .remote import RemoteRequest

log = logging.getLogger(__name__)


def _settle(fut, value) -> None:
    """(event loop) ``fut``'s answer, unless it was given up on (its stream ended)."""
    if not fut.done():
        fut.set_result(value)

BAD_FIRST_TOKEN = "bad_first_token"  # a PrefillDone whose first token is outside the vocabulary


class KVArrival:
    """Notifications in, engine changes out (engine thread; see the module docstring)."""

    def __init__(self, engine: AsyncEngine, agent: KVReceiver, handoffs: Handoffs,
                 owners: Mapping[str, RemoteRequest], metrics: WorkerMetrics, costs: Any = None,
                 peers: PeerPrefixes | None = None):
        self.engine = engine
        self.connector = engine.connector
        self.vocab_size = engine.vocab_size
        self.agent = agent
        self.handoffs = handoffs
        self.owners = owners  # the owners (decode/remote.py): their breakdowns are written here
        self.metrics = metrics
        self.costs = costs  # the router's CostModel, fed with measured prefill/transfer costs
        # Prefix loans (kvtransfer/lending.py, decode/borrow.py): lend messages and reads are
        # taken out of each poll, then the requests whose loan ended are added.
        self.peers = peers
        self.counters = {"notifications": 0, "stale": 0, "malformed": 0, "ready": 0, "fallbacks": 0,
                         "bytes_received": 0, "prefill_failed": 0, "refused_done": 0}
        self.refused_causes: dict[str, int] = {}  # why PrefillDone notices were refused -> count
        self.fallback_causes: dict[str, int] = {}  # fallback reason -> count (the metric's label)

    def count_fallback(self, cause: str) -> None:
        self.fallback_causes[cause] = self.fallback_causes.get(cause, 0) + 1
        self.metrics.fallback(cause)

    def abort(self, rid: str, writer_may_exist: bool) -> None:
        """Drop a request (client gone); an awaited reservation is quarantined when a prefill
        worker may still write it."""
        step = self.handoffs.abort(rid, writer_may_exist)
        if step.stale:  # no awaited attempt: a local (or already running) request
            if self.connector.abort(rid):
                self.engine.deliver_abort(rid)
            return
        self.apply(step)

    def apply(self, step: Step, msg: PrefillDone | PrefillFailed | None = None) -> None:
        """Do to the engine what a transition decided (engine thread only). A stale step (no
        transition) does nothing; REPLACE is `supersede`'s own."""
        h, c = step.handoff, self.connector
        if step.stale or h is None:
            return
        if step.effect is Effect.RUN:
            assert isinstance(msg, PrefillDone)  # only a PrefillDone runs a request (TRANSITIONS)
            self._ready(h, msg)
        elif step.effect in (Effect.FALL_BACK, Effect.FALL_BACK_QUARANTINE):
            c.fall_back(h.request_id, h.quarantine_key if step.effect is Effect.FALL_BACK_QUARANTINE else None)
            self._fell_back(h)
        elif step.effect in (Effect.ABORT, Effect.ABORT_QUARANTINE):
            if c.abort(h.request_id, h.quarantine_key if step.effect is Effect.ABORT_QUARANTINE else None):
                self.engine.deliver_abort(h.request_id)
        elif step.effect is Effect.FREE:
            c.free(h.quarantine_key)

    def supersede(self, owner: RemoteRequest, old: Handoff) -> Reservation | None:
        """A new attempt of ``owner`` replaces ``old`` (engine thread; decode/remote.py, the queue
        restarted): the old blocks go to quarantine, fresh ones are reserved under the next
        epoch. The new Reservation; None when ``old`` is over already (its pages came first, or
        it fell back) or the pool has no room now (the request then prefills locally)."""
        step = self.handoffs.supersede(old.request_id, old.epoch, "superseded: put again after a queue restart")
        if step.stale:
            return None
        res = self.connector.replace(old.request_id, old.quarantine_key)
        if res is None:
            owner.breakdown.update(route="local", fell_back_to_local=True, attempts=old.epoch + 1,
                                   reason="fallback: no KV space to put the task again after a queue restart")
            self.count_fallback("no_kv_space")
            return None
        owner.reservation = res
        owner.attempt = self.handoffs.reserve(old.request_id, old.epoch + 1, len(res.block_ids))
        owner.breakdown["attempts"] = old.epoch + 1
        return res

    def _fell_back(self, h: Handoff) -> None:
        why = h.reason
        self.counters["fallbacks"] += 1
        self.count_fallback(why.split(" ")[0].strip(":"))
        if why.startswith(TRANSFER_ERROR):  # told by NIXL or by the queue: counted once, here
            self.metrics.transfer_failures.inc()
        owner = self.owners.get(h.request_id)
        if owner is not None:
            owner.breakdown.update(route="local", fell_back_to_local=True, attempts=h.epoch,
                                   reason=f"fallback after remote attempt {h.epoch}: {why}")
        log.info("request %s: remote prefill attempt %d abandoned (%s); prefilling locally",
                 h.request_id, h.epoch, why, extra=jsonlog.about(h.request_id))

    def _ready(self, h: Handoff, msg: PrefillDone) -> None:
        """The pages are in place: the request runs from the first token the prefill sent.

        The handoff table alone says an attempt is awaited (kvtransfer/decode_side.py); the engine
        only parks the request with its blocks. Every change of either goes through the table,
        so the engine holds the request here; if it ever did not, that is logged, not raised
        into the engine loop."""
        try:
            delta = self.connector.remote_ready(h.request_id, msg.first_token_id, msg.first_token_logprob,
                                                dict(msg.first_top_logprobs), draft_tokens=msg.draft_tokens)
        except KeyError:
            log.error("request %s: its attempt is ready but the engine parks no such request", h.request_id,
                      extra=jsonlog.about(h.request_id))
            return
        now = time.time()
        # Whole pages land (the last one partly filled): count them as written.
        kv_bytes = self.connector.kv_bytes(h.num_blocks)
        if msg.sent_at > 0:  # the transfer itself: KV complete on the prefill host -> here
            transfer_ms = max(0.0, (now - msg.sent_at) * 1e3)
        else:  # a prefill worker that does not stamp it: what the total leaves
            total_ms = (time.monotonic() - h.started) * 1e3
            transfer_ms = max(0.0, total_ms - msg.queue_wait_ms - msg.prefill_ms)
        owner = self.owners.get(h.request_id)
        if owner is not None:
            owner.breakdown.update(route="remote", prefill_worker=msg.prefill_worker, attempts=msg.epoch,
                                   queue_wait_ms=msg.queue_wait_ms, prefill_ms=msg.prefill_ms,
                                   transfer_ms=transfer_ms, transfer_bytes=kv_bytes)
        self.counters["ready"] += 1
        self.counters["bytes_received"] += kv_bytes
        self.metrics.transfer_bytes.observe(kv_bytes)
        self.metrics.transfer_seconds.observe(transfer_ms / 1e3)
        self._observe(msg, kv_bytes, transfer_ms, h.task)
        self.engine.deliver(delta)

    def _observe(self, msg: PrefillDone, kv_bytes: int, transfer_ms: float, task=None) -> None:
        """Feed the router's cost model (on the event loop, which owns it)."""
        if self.costs is None:
            return
        # The prefill worker's speed relative to this worker's curve, from batches that held
        # this prompt alone (a batch of several has another shape of attention work).
        alone = task is not None and msg.batch_tokens == len(task.token_ids) - task.cached_len

        def feed():
            if alone and msg.prefill_ms > 0:
                self.costs.observe_remote_prefill(msg.batch_tokens, task.cached_len, msg.prefill_ms)
            if transfer_ms > 0:
                self.costs.observe_transfer(kv_bytes, transfer_ms)
            if msg.lora_load_ms > 0:  # the prefill worker read the request's LoRA adapter first
                self.costs.observe_lora_load(msg.lora_load_ms)

        self.engine.to_loop(feed)

    def _on_notification(self, msg: PrefillDone | PrefillFailed, sender: str = "") -> None:
        if isinstance(msg, PrefillFailed):
            self.counters["prefill_failed"] += 1
            worker = f" on {msg.prefill_worker}" if msg.prefill_worker else ""
            step = self.handoffs.failed(msg.request_id, msg.epoch, msg.writes_settled,
                                        f"{msg.kind}{worker}: {msg.detail}")
        else:
            refused = self.handoffs.check_done(msg.request_id, msg.epoch, msg.num_tokens_written)
            if refused is not None:
                self._refuse(msg, sender, refused)
                return
            if not 0 <= msg.first_token_id < self.vocab_size:
                # A token the model does not have would fail the whole next step (and a CUDA
                # context): refused; its writes are over, so the request prefills locally now.
                self._refuse(msg, sender, BAD_FIRST_TOKEN)
                step = self.handoffs.failed(msg.request_id, msg.epoch, True,
                                            f"{BAD_FIRST_TOKEN}: first token {msg.first_token_id} is not in the "
                                            f"vocabulary of {self.vocab_size} from {sender or '?'}")
                self.apply(step, msg)
                return
            mismatch = self._adapter_mismatch(msg)
            if mismatch is not None:
                # Pages computed under another LoRA adapter (or the base) are not this request's
                # KV: refused, and (its writes are over) the request prefills locally now.
                self._refuse(msg, sender, mismatch.reason)
                self.apply(self.handoffs.failed(msg.request_id, msg.epoch, True,
                                                f"{mismatch.reason}: {mismatch} (from {sender or '?'})"), msg)
                return
            step = self.handoffs.done(msg.request_id, msg.epoch)
        if step.stale or step.effect is Effect.FREE:  # ignored, or the late end of an abandoned attempt
            self.counters["stale"] += 1
        self.apply(step, msg)

    def _adapter_mismatch(self, msg: PrefillDone) -> AdapterMismatchError | None:
        """Why the awaited attempt ``msg`` names must not run from its pages: they were computed
        under another adapter than the task this worker signed (kvtransfer/decode_side.py
        `check_adapter`); None when they fit, or when the attempt is not the awaited one (a
        quarantined attempt's notice only frees its blocks)."""
        h = self.handoffs.awaited(msg.request_id)
        if h is None or h.epoch != msg.epoch:
            return None
        try:
            check_adapter(h.task, msg.lora_name, msg.lora_int_id)
        except AdapterMismatchError as exc:
            return exc
        return None

    def _refuse(self, msg: PrefillDone, sender: str, reason: str) -> None:
        self.counters["refused_done"] += 1
        self.refused_causes[reason] = self.refused_causes.get(reason, 0) + 1
        self.metrics.refused_notification(reason)
        log.warning("PrefillDone from %s for request %s attempt %d (%d tokens) refused: %s", sender or "?",
                    msg.request_id, msg.epoch, msg.num_tokens_written, reason, extra=jsonlog.about(msg.request_id))

    def take_reservations(self) -> bool:
        """The blocks the scheduler reserved for requests routed remote (in the step that
        admitted them, engine/remote_kv.py): each becomes its owner's attempt 1, and the owner
        hears of it (or that there was no room: it prefills locally)."""
        news = self.connector.take_reservations()
        for rid, res in news:
            owner = self.owners.get(rid)
            if res is not None and self.connector.is_awaiting(rid):  # (not aborted since)
                attempt = self.handoffs.reserve(rid, 1, len(res.block_ids))
                if owner is not None:
                    owner.reservation, owner.attempt = res, attempt
            if owner is not None and owner.reserved is not None:
                self.engine.to_loop(_settle, owner.reserved, res)
        return bool(news)

    def poll(self) -> bool:
        """Engine-thread poller: reservations, transport progress, notifications, quarantine
        expiry."""
        did = self.take_reservations()
        res = self.agent.poll()
        notes = res.notifications
        if self.peers is not None:
            did = did or bool(notes) or bool(self.peers.lending.borrower.tickets)
            notes = self.peers.lending.on_poll(res)
            self.peers.after_poll()
        for note in notes:
            did = True
            self.counters["notifications"] += 1
            try:
                msg = decode_notification(note.payload)
            except MalformedNoticeError as exc:
                self.counters["malformed"] += 1
                log.warning("malformed notification from %s ignored: %s", note.sender, exc)
                continue
            self._on_notification(msg, note.sender)
        for step in self.handoffs.expire():
            self.apply(step)
        # While pages are awaited, keep the loop polling briskly.
        self.engine.poll_briskly(self.handoffs.num_awaiting > 0)
        return did
