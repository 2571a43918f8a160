"""A prefill worker's prefix loans (kvtransfer/lending.py): what it borrows, what it lends.

Borrowing: before a batch is computed, each task's longest prefix another worker holds, past
what this pool holds, is borrowed and read when that is predicted cheaper than computing it
(`borrow`), so the batch computes only the rest.

Lending: other workers' loan requests are answered by every poll of the sender, each handed
to `Lending.on_poll` (`poll`): between a batch's steps (`between_steps`, on the batch
thread) and between batches (`run`, which polls on the compute thread while no batch holds
the engine). A borrower met for the first time is looked up in etcd, then answered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from pdserve.common.compute_thread import ComputeExecutor
from pdserve.engine import LLMEngine
from pdserve.kvtransfer.borrower import MIN_BORROW_BLOCKS
from pdserve.kvtransfer.lending import Lending
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.kvtransfer.nixl.transfer import PollResult
from pdserve.kvtransfer.task import PrefillTask
from pdserve.router.costs import CostModel

from .values import PrefillStats
from .peers import Peers
from .progress import WAIT_SLACK_S

log = logging.getLogger(__name__)

LEND_POLL_S = 0.005  # between batches, how often loan requests are answered


class PrefixLoans:
    """Both ends of one prefill worker's prefix loans over its sender and engine. ``lock`` is
    the worker's engine lock, held by whoever drives the engine and the sender: a batch (its
    thread), or between batches the loan answers (`run`). ``costs``: what a borrow costs
    against computing the same tokens here, learned from this worker's own steps and reads."""

    def __init__(self, worker_id: str, engine: LLMEngine, sender: TPSender, lending: Lending, peers: Peers,
                 costs: CostModel, stats: PrefillStats, compute: ComputeExecutor, lock: threading.Lock):
        self.worker_id = worker_id
        self.engine = engine
        self.sender = sender
        self.lending = lending
        self.peers = peers
        self.costs = costs
        self.stats = stats
        self.compute = compute
        self.lock = lock
        lending.traced_as("prefill")  # a traced task's loans join its trace (common/tracing.py)

    def poll(self) -> PollResult:
        """Poll the sender, answering the loan messages and reads first: the notifications left."""
        res = self.sender.poll()
        return PollResult(res.completed, res.failed, self.lending.on_poll(res))

    # -- the batch thread ----------------------------------------------------------------------
    def before_batch(self, tasks: list[PrefillTask], peers_added: bool) -> None:
        """At a batch's start (batch thread, engine lock held): answer the borrowers whose records
        were just registered (`peers_added`), then borrow the batch's prefixes."""
        if peers_added:
            self.lending.lender.retry()  # borrowers met meanwhile
        self.borrow(tasks)

    def borrow(self, tasks: list[PrefillTask]) -> None:
        """Before a batch is computed (batch thread): for each task, the longest prefix of its
        prompt another worker holds, past what this pool holds, when it is at least
        MIN_BORROW_BLOCKS more: borrowed and read (kvtransfer/lending.py), so the batch
        computes only the rest. The sources: the task's target decode worker, which holds its
        first ``cached_len`` tokens, and the prefill workers its hint names. Bounded by the
        loans' deadline; whatever is not read in time is computed as usual."""
        borrower = self.lending.borrower
        started = sum(self._start_borrow(t) for t in tasks)
        if not started:
            return
        deadline = time.monotonic() + borrower.lease_ms / 2e3 + 0.5
        self.compute.progress.mark(deadline - time.monotonic() + WAIT_SLACK_S)  # the loans' wait, bounded
        while borrower.tickets and time.monotonic() < deadline:
            self.poll()  # grants, reads and their ends
            time.sleep(0.0005)
        for r in borrower.take_results():
            self.stats.borrows[r.outcome] += 1
            self.stats.borrowed_tokens += r.read_tokens
            if r.outcome == "read" and r.read_tokens and r.elapsed_s > 0:  # the whole loan: ask, grant, read
                self.costs.observe_transfer(r.read_tokens * self.engine.connector.kv_bytes_per_token,
                                            r.elapsed_s * 1e3)

    def _start_borrow(self, t: PrefillTask) -> bool:
        """Ask for the longest prefix of `t` worth borrowing; whether a loan was asked for."""
        conn, bs, lenders = self.engine.connector, self.engine.config.block_size, self.peers.lenders
        sources = {h: n for h, n in t.prefix_hint.items() if h != self.worker_id and lenders.get(h)}
        if lenders.get(t.target_worker_id):
            sources[t.target_worker_id] = max(sources.get(t.target_worker_id, 0), t.cached_len)
        if not sources:
            return False
        holder, tokens = max(sources.items(), key=lambda kv: (kv[1], kv[0]))
        tokens = min(tokens, ((len(t.token_ids) - 1) // bs) * bs)
        have = conn.cached_prefix_len(t.token_ids)
        if tokens - have < MIN_BORROW_BLOCKS * bs or holder not in self.peers.known:
            return False
        cheaper, read_ms, compute_ms = self.costs.snapshot().borrow_cheaper(tokens - have, have)
        if not cheaper:  # reading is no cheaper: compute (counted, explained at debug)
            self.stats.borrows["not_cheaper"] += 1
            log.debug("task %s: %d tokens of %s not borrowed: read %.1f ms >= compute %.1f ms", t.request_id,
                      tokens - have, holder, read_ms, compute_ms)
            return False
        return self.lending.borrower.start(t.token_ids, holder, tokens // bs, tag=t.request_id,
                                           traceparent=t.traceparent or None) is not None

    def between_steps(self) -> None:
        """Between a batch's steps (batch thread): the loan requests that arrived meanwhile,
        and those of borrowers met meanwhile."""
        try:
            if self.peers.pending and self.peers.sync({}, {}, mid_batch=True):
                self.lending.lender.retry()
            self.poll()
        except Exception as exc:  # noqa: BLE001  (the transport's trouble shows in the batch's own writes)
            log.debug("lend poll failed: %r", exc)

    # -- between batches -------------------------------------------------------------------------
    async def run(self) -> None:
        """Between batches, answer other workers' loan requests (a batch's own polls answer
        them while it runs): poll the sender every LEND_POLL_S while no batch holds the engine;
        a borrower met for the first time is looked up in etcd, then answered."""
        lender = self.lending.lender
        while True:
            await asyncio.sleep(LEND_POLL_S)
            if not self.lock.locked():
                # On the compute thread, not this loop: an answer may load a chain back from the
                # tier or, at TP>1, wait for the other ranks' copies (engine/kv_connector.py).
                await self.compute.run(self._lend_poll)
            for name in lender.waiting_for_peers():
                problem = await self.peers.fetch(name, self.peers.pending)
                if problem is not None:
                    log.info("loan request from %s not answerable: %s", name, problem)
            if (self.peers.pending or lender.waiting) and not self.lock.locked():
                # No batch under way: register them now (a batch would, between its steps).
                await self.compute.run(self._answer_waiting_borrowers)

    def _lend_poll(self) -> None:
        """Between batches (compute thread): poll the sender, which answers the loan requests."""
        if self.lock.acquire(blocking=False):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001  (the transport's trouble shows in the batches too)
                log.debug("lend poll failed: %r", exc)
            finally:
                self.lock.release()

    def _answer_waiting_borrowers(self) -> None:
        with self.lock:  # (after the batch that may have started meanwhile)
            self.peers.sync({}, {})
            self.lending.lender.retry()
