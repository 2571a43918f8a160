"""The transport of a worker whose KV pool, or whose peer's, is split over tensor-parallel ranks.

Each rank has its own NIXL agent over its own pool (rank 0's lives in the worker process,
the others' in their rank processes: kvtransfer/nixl/rank_service.py). `open_worker_transport`
opens them all and gives the worker its `WorkerTransport`: the record it publishes (listing
its ranks' agents, kvtransfer/nixl/ranks.py), its sender (`TPSender`, the prefill side's
`KVSender` and the loans' transport: kvtransfer/nixl/tp_sender.py) and its receiver
(`TPReceiver`, the decode side's `KVReceiver`: kvtransfer/nixl/tp_receiver.py). Between two
single-rank workers the sender's and the receiver's calls go straight to the agent, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.kvtransfer.nixl.ranks import RankGroup, group_of, ranks_record
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender

if TYPE_CHECKING:
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent

class _Model(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def num_kv_heads(self) -> int: ...


class _Connector(Protocol):
    @property
    def kv_tensor(self) -> Any: ...  # (a torch.Tensor: the pool NIXL registers)

    @property
    def kv_layout(self) -> str: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def tp_group(self) -> RankGroup | None: ...

    def layout_info(self) -> dict: ...

    def draft_pool(self) -> tuple[Any, dict] | None: ...  # a speculative draft model's pool, and its layout facts


class RankedEngine(Protocol):
    """What opening the transport reads of an engine (engine/llm_engine.py `LLMEngine`)."""

    @property
    def model_config(self) -> _Model: ...

    @property
    def connector(self) -> _Connector: ...


RANK_EXTENSION = "pdserve.kvtransfer.nixl.rank_service:RankTransfer"


def with_rank_transport(engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's engine arguments: a tensor-parallel engine's ranks also run the transport."""
    out = dict(engine_args)
    if int(out.get("tensor_parallel_size", 1) or 1) > 1:
        out.setdefault("tp_rank_extension", RANK_EXTENSION)
    return out


@dataclass
class WorkerTransport:
    """One worker's transport over its engine's ranks: rank 0's agent here, the others' in their
    rank processes; `record` is what the worker publishes for its peers."""

    agent: KVTransferAgent  # rank 0's
    record: dict[str, Any]
    tp: int
    num_kv_heads: int
    group: RankGroup | None

    def sender(self) -> TPSender:
        return TPSender(self.agent, self.num_kv_heads, self.tp, self.group)

    def receiver(self) -> TPReceiver:
        return TPReceiver(self.agent, self.num_kv_heads, self.tp, self.group)


def open_worker_transport(worker_id: str, engine: RankedEngine, ucx_env: Mapping[str, str] | None = None,
                          threads: int = 0) -> WorkerTransport:
    """Open an agent on every rank of ``engine`` (an `LLMEngine`, started with
    `with_rank_transport` arguments when it has several ranks), each posting large writes
    from ``threads`` threads (`KVTransferAgent` num_threads)."""
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.layout import KVLayout

    m, conn = engine.model_config, engine.connector
    tp, group = conn.tensor_parallel_size, conn.tp_group
    kv = conn.kv_tensor
    info = conn.layout_info()
    layout = KVLayout.from_tensor(kv, m.model_id, kv_layout=conn.kv_layout, total_kv_heads=m.num_kv_heads,
                                  tp_size=tp, tp_rank=0, kv_cache_dtype=info.get("kv_cache_dtype", "auto"),
                                  kv_scales=info.get("kv_scales", ()))
    pools = {}
    draft = conn.draft_pool()
    if draft is not None:  # (rank 0's: the draft runs whole there; kvtransfer/nixl/pools.py)
        dkv, dinfo = draft
        pools["draft"] = (dkv, KVLayout.from_tensor(dkv, dinfo["model_id"], kv_layout=dinfo["kv_layout"],
                                                    total_kv_heads=dinfo["num_kv_heads"], tp_size=1, tp_rank=0,
                                                    kv_cache_dtype=dinfo.get("kv_cache_dtype", "auto"),
                                                    kv_scales=dinfo.get("kv_scales", ())))
    agent = KVTransferAgent(worker_id, kv, layout, ucx_env=ucx_env, num_threads=threads, pools=pools)
    infos = [agent.local_info()]
    if tp > 1:
        try:
            replies = group_of(group).call("open", worker_id=worker_id, model_id=m.model_id,
                                           total_kv_heads=m.num_kv_heads, ucx_env=dict(ucx_env or {}), threads=threads)
            infos += [r["info"] for r in replies]
        except BaseException:
            agent.close()
            raise
    return WorkerTransport(agent, ranks_record(worker_id, infos), tp, m.num_kv_heads, group)
