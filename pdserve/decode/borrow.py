"""A decode worker's prefix loans (kvtransfer/lend.py): it borrows what prefill workers hold
for the prompts it prefills itself, and lends what it holds.

**Borrowing.** When a request is prefilled here (the router chose local) and a prefill
worker holds a longer prefix of it than this pool does (the prefix view of their KV
events, `Prepared.prefix_hint`), and reading those blocks is predicted cheaper than
computing them (the cost model's transfer time against its prefill compute), the
request waits for the loan: its stream is attached, the engine thread asks the holder
(`Borrower.start`) and adds the request once the read is over, whatever its outcome. A
read makes the prefix a pool hit; anything else leaves the request to compute it, as it
would have. Only a holder this worker has met is asked: meeting one (its NIXL record read
from etcd, then registered on the engine thread) takes a round trip and an engine step, too
long to sit inside a loan's wait, so a lending prefill worker is met as soon as its record
appears (`member`), and a holder still unmet is met in the background for the next request.

**Lending.** Prefill workers (and other decode workers) may borrow from this pool; a
borrower this agent has not met is looked up in etcd before it is answered.

Engine state changes on the engine thread only (`AsyncEngine.call`, KVArrival's poll).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from pdserve.kvtransfer.borrower import MIN_BORROW_BLOCKS
from pdserve.kvtransfer.lend import AGENT_INCARNATION_KEY, lends
from pdserve.kvtransfer.lending import Lending

from .async_engine import AsyncEngine

log = logging.getLogger(__name__)

PEER_LOOKUP_TIMEOUT_S = 5.0
UNKNOWN_BORROWER_CHECK_S = 0.02


class PeerPrefixes:
    """Both halves of this worker's loans (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, lending: Lending, agent, fetch_metadata: Callable[[str], Awaitable]):
        self.engine = engine
        self.lending = lending
        if lending is not None:  # a traced request's loans join its trace (common/tracing.py)
            lending.traced_as("decode")
        self.agent = agent  # the loans' transport (a TPSender: peers met on every rank, reads rank by rank)
        self.fetch_metadata = fetch_metadata  # async worker id -> its NIXL record bytes, or None
        self.block_size = engine.block_size
        self.counters = {"borrows": 0, "borrowed_tokens": 0, "borrow_fallbacks": 0, "peer_lookup_failures": 0,
                         "borrow_wait_ms": 0.0}  # the requests' total wait for their loans
        self._task: asyncio.Task | None = None
        self._args: dict[str, tuple] = {}  # request id -> what to add once its loan ends (engine thread)
        self.lenders: set[str] = set()  # prefill workers whose records say they lend (the prefill watch)
        self._meeting: dict[str, asyncio.Task] = {}  # worker id -> its ensure_peer under way
        self._incarnations: dict[str, str] = {}  # worker id -> its agent's incarnation (its record's capacity)

    # -- deciding (event loop) ----------------------------------------------------------------
    def member(self, info) -> None:
        """A prefill worker's record (added or updated): whether it lends, and whether it is a
        new incarnation of a worker met before (restarted under its id: its agent is new, so
        its NIXL record is loaded again, replacing the old agent's)."""
        incarnation = info.capacity.get(AGENT_INCARNATION_KEY)
        restarted = incarnation is not None and self._incarnations.get(info.worker_id, incarnation) != incarnation
        if incarnation is not None:
            self._incarnations[info.worker_id] = incarnation
        if restarted:
            log.info("%s restarted (a new NIXL agent): its record is loaded again", info.worker_id)
        if lends(info.capacity):
            self.lenders.add(info.worker_id)
            self.meet(info.worker_id, replace=restarted)  # before its first loan (it borrows from this pool too)
        else:
            self.lenders.discard(info.worker_id)

    def meet(self, worker_id: str, replace: bool = False) -> None:
        """Load ``worker_id``'s NIXL record in the background, unless known (``replace``: known
        from an earlier incarnation, loaded again) or under way."""
        if (worker_id in self.agent.peers and not replace) or worker_id in self._meeting:
            return
        task = asyncio.get_running_loop().create_task(self.ensure_peer(worker_id, replace))
        self._meeting[worker_id] = task
        task.add_done_callback(lambda _t: self._meeting.pop(worker_id, None))

    def gone(self, info) -> None:
        self.lenders.discard(info.worker_id)

    def choose(self, hint: dict[str, int], cached_len: int, prompt_len: int, costs,
               tier_len: int = 0) -> tuple[str, int] | None:
        """(holder, blocks) to borrow for a local prefill, or None: no holder with at least
        MIN_BORROW_BLOCKS more than this pool and its second tier hold (``tier_len`` tokens past
        ``cached_len``: loading them back is cheaper still), or reading them is predicted no
        cheaper than computing them (``costs``: the router's CostEstimates). Only holders this
        worker has met are asked; the others are met now, for the next request."""
        hint = {w: n for w, n in hint.items() if w in self.lenders}
        for w in [w for w in hint if w not in self.agent.peers]:
            self.meet(w)
            del hint[w]
        if not hint:
            return None
        holder, tokens = max(hint.items(), key=lambda kv: (kv[1], kv[0]))
        tokens = min(tokens, ((prompt_len - 1) // self.block_size) * self.block_size)
        gain = tokens - cached_len
        if gain - tier_len < MIN_BORROW_BLOCKS * self.block_size:
            return None
        if costs is not None and not costs.borrow_cheaper(gain, cached_len)[0]:
            return None
        return holder, tokens // self.block_size

    # -- borrowing ------------------------------------------------------------------------------
    async def submit(self, prep, holder: str, blocks: int) -> asyncio.Queue:
        """Like `AsyncEngine.submit`, after borrowing the prefix from ``holder`` (the request is
        added when the loan ends, read or not)."""
        known = await self.ensure_peer(holder)
        q = self.engine.attach(prep.request_id)
        rid, ids, params, prio, tenant = (prep.request_id, prep.prompt_ids, prep.params, int(prep.priority),
                                          prep.tenant)
        traceparent = prep.traceparent

        def start(eng) -> None:
            self.engine.add_later(rid)
            lend_id = self.lending.borrower.start(ids, holder, blocks, tag=rid,
                                                  traceparent=traceparent) if known else None
            if lend_id is None:
                self.counters["borrow_fallbacks"] += 1
                self.engine.add_held(rid, ids, params, prio, tenant)
            else:
                self._args[rid] = (ids, params, prio, tenant)

        self.engine.call(start)
        return q

    def after_poll(self) -> None:
        """Engine thread (KVArrival's poll, after the lending traffic): add the requests whose
        loan ended."""
        for r in self.lending.borrower.take_results():
            args = self._args.pop(r.tag, None)
            if args is None:
                continue
            self.counters["borrow_wait_ms"] += r.elapsed_s * 1e3
            if r.outcome == "read":
                self.counters["borrows"] += 1
                self.counters["borrowed_tokens"] += r.read_tokens
            else:
                self.counters["borrow_fallbacks"] += 1
            self.engine.add_held(r.tag, *args)

    async def ensure_peer(self, worker_id: str, replace: bool = False) -> bool:
        """This agent knows ``worker_id`` (its NIXL record loaded from etcd if it did not, or
        with ``replace`` in place of the one it has: the worker restarted)."""
        if worker_id in self.agent.peers and not replace:
            return True
        try:
            raw = await asyncio.wait_for(self.fetch_metadata(worker_id), PEER_LOOKUP_TIMEOUT_S)
            if raw is None:
                raise LookupError(f"{worker_id} has no NIXL record in etcd")
            info = json.loads(raw)
        except Exception as exc:  # noqa: BLE001  (etcd slow or down, the worker gone: no loan)
            self.counters["peer_lookup_failures"] += 1
            log.info("NIXL record of %s not available: %r", worker_id, exc)
            return False
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def add(eng) -> None:
            try:
                if replace and worker_id in self.agent.peers:
                    self.agent.remove_peer(worker_id)  # the old incarnation's agent (engine thread: its only user)
                if worker_id not in self.agent.peers:
                    self.agent.add_peer(info)
                ok = True
            except Exception as exc:  # noqa: BLE001  (a layout this pool cannot read from)
                log.warning("NIXL record of %s refused: %r", worker_id, exc)
                ok = False

            def settle() -> None:
                if not done.done():
                    done.set_result(ok)

            loop.call_soon_threadsafe(settle)

        self.engine.call(add)
        try:
            return await asyncio.wait_for(done, PEER_LOOKUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False

    # -- lending ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._serve_unknown_borrowers())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._meeting.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve_unknown_borrowers(self) -> None:
        """Borrowers whose requests wait for their NIXL record: load it, then answer them."""
        while True:
            await asyncio.sleep(UNKNOWN_BORROWER_CHECK_S)
            names = self.lending.lender.waiting_for_peers()  # (a read of the engine thread's list)
            if not names:
                continue
            for name in names:
                await self.ensure_peer(name)
            self.engine.call(lambda eng: self.lending.lender.retry())
