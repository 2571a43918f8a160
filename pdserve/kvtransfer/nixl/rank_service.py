"""The KV transport inside a tensor-parallel rank other than 0 (an engine rank extension).

A worker with ``tensor_parallel_size > 1`` starts its engine with
``tp_rank_extension="pdserve.kvtransfer.nixl.rank_service:RankTransfer"``, so each rank
process also owns a NIXL agent over its own pool; rank 0 drives it
(kvtransfer/nixl/tp_transport.py) through the TP group's control requests and step attachments
(engine/tp_rank.py gives the protocol):

    open(worker_id, model_id, total_kv_heads, ucx_env)  create the agent (named for this
                                                    rank: ranks.rank_agent_name); its record
    add_peer(infos) / remove_peer(names)            the peer workers' rank agents
    (step attachment) {"kind": "stream", ...}       begin this rank's streams of a request;
                                                    the layer hook posts each layer as the
                                                    rank's forward computes it
    finish(key, notify, timeout_s)                  wait the request's writes, then send each
                                                    (this rank, decode rank) pair its notice
    abort(key) / settle(key, timeout_s)             give up; report whether writes can still land
    write(...)                                      a whole-request write, waited for
    poll()                                          the notices this rank received (decode side)
    read(key, peer, local, remote, reads)           post this rank's reads of a lent prefix (its
                                                    heads, from the holder ranks the plan names)
    read_poll(keys)                                 how those reads stand (finished, failed: why)

Between requests the rank's idle time drives the agent's progress and collects the
notifications that arrive (a target must keep polling, or NIXL's wire-up stalls).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kvtransfer.ranked import wrap
from pdserve.kvtransfer.nixl.errors import TransferError, TransferTimeoutError
from pdserve.kvtransfer.nixl.layout import KVLayout

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent

log = logging.getLogger(__name__)

MAX_HELD_NOTES = 100_000
READ_KEEP_S = 120.0  # a read nobody asks about any more is forgotten after this (its borrow ended long ago)


@dataclass
class _Read:
    since: float
    handles: list
    error: str | None = None

    def state(self, key: int) -> dict:
        error = self.error or next((h.error or "the read failed" for h in self.handles if h.failed), None)
        return {"key": key, "finished": all(h.finished for h in self.handles), "failed": error,
                "bytes": sum(h.num_bytes for h in self.handles if h.done)}


class RankTransfer:
    def __init__(self, runner, rank: int, size: int):
        self.runner, self.rank, self.size = runner, rank, size
        self.agent: KVTransferAgent | None = None
        self.streams: dict[int, list] = defaultdict(list)  # key -> [(decode rank, dst tp, stream)]
        self.errors: dict[int, str] = {}  # key -> why this rank's part failed before finish
        self.notes: list[tuple[str, bytes]] = []
        self._step_streams: list = []
        self.reads: dict[int, _Read] = {}  # key -> this rank's reads of a lent prefix

    # -- control requests -------------------------------------------------------------
    def handle(self, op: str, args: dict) -> dict:
        """A control request; a write that failed is a normal reply (``failed``: why), what
        raises here is a broken request (rank 0 gets it as TPControlError)."""
        fn = getattr(self, f"_op_{op}", None)
        if fn is None:
            raise ValueError(f"unknown transport request {op!r}")
        if op != "open" and self.agent is None:
            raise RuntimeError("this rank's transport agent is not open yet")
        return fn(**args) or {}

    @property
    def _agent(self) -> KVTransferAgent:
        """The open agent: `handle` runs no request but ``open`` before there is one."""
        if self.agent is None:
            raise RuntimeError("this rank's transport agent is not open yet")
        return self.agent

    def _op_open(self, worker_id: str, model_id: str, total_kv_heads: int, ucx_env: dict | None = None,
                 threads: int = 0) -> dict:
        from pdserve.kvtransfer.nixl.agent import KVTransferAgent
        from pdserve.kvtransfer.nixl.ranks import rank_agent_name

        name = rank_agent_name(worker_id, self.rank)
        kv = self.runner.kv_cache
        info = self.runner.layout_info()
        layout = KVLayout.from_tensor(kv, model_id, kv_layout=self.runner.kv_layout, total_kv_heads=total_kv_heads,
                                      tp_size=self.size, tp_rank=self.rank,
                                      kv_cache_dtype=info.get("kv_cache_dtype", "auto"),
                                      kv_scales=info.get("kv_scales", ()))
        self.agent = KVTransferAgent(name, kv, layout, ucx_env=ucx_env, num_threads=threads)
        return {"info": self.agent.local_info()}

    def _op_add_peer(self, infos: list) -> dict:
        return {"names": [self._agent.add_peer(i) for i in infos]}

    def _op_remove_peer(self, names: list) -> dict:
        return {"removed": [self._agent.remove_peer(n) for n in names]}

    def _op_finish(self, key: int, notify: bytes | None, timeout_s: float) -> dict:
        streams = self.streams.pop(key, [])
        error = self.errors.pop(key, None)
        if error is not None:
            for _, _, s in streams:
                s.abort()
            return {"failed": error, "bytes": 0}
        total = 0
        try:
            for dst, dst_tp, stream in streams:
                note = None if notify is None else wrap(notify, self.rank, self.size, dst, dst_tp)
                total += sum(h.num_bytes for h in stream.finish(timeout_s, notify=note))
        except TransferTimeoutError as exc:
            return {"failed": str(exc), "timed_out": True, "bytes": total}
        except TransferError as exc:
            return {"failed": str(exc), "bytes": total}
        return {"bytes": total}

    def _op_abort(self, key: int) -> dict:
        for _, _, s in self.streams.pop(key, []):
            s.abort()
        self.errors.pop(key, None)
        return {}

    def _op_settle(self, key: int, timeout_s: float) -> dict:
        streams = self.streams.pop(key, [])
        self.errors.pop(key, None)
        settled = True
        for _, _, s in streams:
            s.abort()
            settled = s.settle_posts(timeout_s) and settled
            for h in list(s.handles.values()):
                if h.finished:
                    continue
                try:
                    self._agent.wait(h, timeout_s)
                except TransferTimeoutError:
                    settled = False
                except TransferError:
                    pass
        return {"settled": settled}

    def _op_write(self, peer: list, dst_tp: int, local: list, remote: list, notify: bytes | None, timeout_s: float,
                  writes: list) -> dict:
        handles = []
        try:
            for src, dst, src_head, dst_head, num_heads in writes:
                if src != self.rank:
                    continue
                note = None if notify is None else wrap(notify, self.rank, self.size, dst, dst_tp)
                handles.append(self._agent.write_blocks(peer[dst], local, remote, notify=note,
                                                        heads=(src_head, dst_head, num_heads)))
            deadline = time.monotonic() + timeout_s
            for h in handles:
                self._agent.wait(h, max(deadline - time.monotonic(), 0.0))
        except TransferTimeoutError as exc:
            return {"failed": str(exc), "timed_out": True}
        except (TransferError, ValueError) as exc:
            return {"failed": f"{exc.__class__.__name__}: {exc}"}
        return {"bytes": sum(h.num_bytes for h in handles)}

    def _op_read(self, key: int, peer: list, local: list, remote: list, reads: list) -> dict:
        """Post this rank's reads; never raises (what could not be posted is the read's error)."""
        handles, error = [], None
        try:
            for src, dst, local_head, remote_head, num_heads in reads:
                if dst == self.rank:
                    handles.append(self._agent.read_blocks(peer[src], local, remote,
                                                           heads=(local_head, remote_head, num_heads)))
        except Exception as exc:  # noqa: BLE001  (an unknown holder rank, a layout mismatch)
            error = f"{exc.__class__.__name__}: {exc}"
        self.reads[key] = _Read(time.monotonic(), handles, error)
        return self.reads[key].state(key)

    def _op_read_poll(self, keys: list) -> dict:
        self.idle()  # (the agent's progress settles the reads)
        out = []
        for key in keys:
            read = self.reads.get(key)
            out.append(read.state(key) if read is not None else {"key": key, "finished": True, "failed": None})
            if out[-1]["finished"]:
                self.reads.pop(key, None)
        now = time.monotonic()
        for key in [k for k, r in self.reads.items() if now - r.since > READ_KEEP_S]:
            del self.reads[key]
        return {"reads": out}

    def _op_poll(self) -> dict:
        self.idle()
        notes, self.notes = self.notes, []
        return {"notes": [[s, p] for s, p in notes]}

    # -- steps --------------------------------------------------------------------------
    def on_step(self, attached: list):
        self._step_streams = []
        for item in attached:
            if item.get("kind") != "stream" or self.agent is None:
                continue
            key = item["key"]
            for src, dst, src_head, dst_head, num_heads in item["writes"]:
                if src != self.rank:
                    continue
                try:
                    stream = self.agent.begin_stream(item["peer"][dst], item["local"], item["remote"], None,
                                                     heads=(src_head, dst_head, num_heads))
                except (TransferError, ValueError) as exc:
                    self.errors[key] = f"{exc.__class__.__name__}: {exc}"
                    continue
                self.streams[key].append((dst, item["dst_tp"], stream))
                self._step_streams.append((key, stream))
        if not self._step_streams:
            return None
        return self._after_layer

    def _after_layer(self, layer: int, ready) -> None:
        for key, stream in self._step_streams:
            if key in self.errors:
                continue
            try:
                stream.write_layer(layer, ready)
            except Exception as exc:  # noqa: BLE001  (this request fails on finish; the step goes on)
                self.errors[key] = f"{exc.__class__.__name__}: {exc}"

    def after_step(self) -> None:
        self._step_streams = []

    def idle(self) -> None:
        if self.agent is None:
            return
        try:
            res = self.agent.poll()
        except TransferError as exc:
            log.warning("transport progress failed: %s", exc)
            return
        self.notes += [(n.sender, n.payload) for n in res.notifications]
        if len(self.notes) > MAX_HELD_NOTES:  # nobody asked for them: rank 0 is gone or stuck
            del self.notes[:len(self.notes) - MAX_HELD_NOTES]

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
