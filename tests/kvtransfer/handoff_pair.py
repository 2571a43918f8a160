"""A prefill engine and a decode engine paired by the product's transport, for the handoff tests.

`paired` starts both engines (tensor-parallel ones with their ranks in their own processes) and
opens their transports as a worker does (kvtransfer/nixl/tp_transport.py: one NIXL agent per
rank over loopback UCX), the decode side a peer of the prefill side's sender. `Pair.tasks`
reserves the decode side's blocks for prompts, as the decode worker's remote path does;
`Pair.prefill` runs the real prefill batch (prefill/batch.py) while a thread polls the decode
side's transport (a NIXL target must poll, or wire-up stalls); `Pair.hand_over` gives each
notice to the decode engine (the first token, or a local fallback for a failed task) and
`Pair.decode` runs it to the end. Everything is closed when the block exits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV
from pdserve.kvtransfer.nixl.tp_receiver import TPReceiver
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.kvtransfer.nixl.tp_transport import WorkerTransport, open_worker_transport, with_rank_transport
from pdserve.prefill.batch import BatchResult, PrefillBatch
from pdserve.prefill.values import PrefillStats

# A small pool (so a test can fragment it) and room for a few prompts per step.
DEFAULT_ARGS = {"num_gpu_blocks_override": 96, "max_num_batched_tokens": 512}


def engine(model: str, tp: int = 1, **args: Any) -> LLMEngine:
    """An engine as a worker of ``tp`` ranks starts it (its ranks run the transport)."""
    kw = with_rank_transport({**DEFAULT_ARGS, **args, "tensor_parallel_size": tp})
    return LLMEngine(EngineConfig.from_kwargs(model, **kw))


@dataclass
class Pair:
    pe: LLMEngine
    de: LLMEngine
    pt: WorkerTransport
    dt: WorkerTransport
    sender: TPSender
    receiver: TPReceiver
    peer: Any  # the decode side as the sender's peer
    stats: PrefillStats = field(default_factory=PrefillStats)  # the prefill batches' counters

    def warm_prefix(self, prompt: Sequence[int], tokens: int = 48) -> None:
        """The decode side computes and caches ``prompt[:tokens]`` (a prefix it then holds)."""
        self.de.add_request(list(prompt[:tokens]) + [7], SamplingParams(max_tokens=1), request_id="warm")
        self.decode()
        self.de.release("warm")

    def tasks(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
              prefix: str = "r") -> list[PrefillTask]:
        """One task per prompt (request ids ``<prefix><i>``), its blocks reserved on the decode side."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        out = []
        for i, (p, sp) in enumerate(zip(prompts, each)):
            res = self.de.connector.reserve(self.de.make_request(list(p), sp, request_id=f"{prefix}{i}"))
            assert res is not None, f"no room on the decode side for {prefix}{i}"
            out.append(PrefillTask(f"{prefix}{i}", 1, list(p), res.cached_len, self.peer, res.block_ids, sp.to_dict(),
                                   draft_block_ids=list(res.draft_block_ids)))
        return out

    def prefill(self, tasks: list[PrefillTask], layerwise: bool = False, timeout_s: float = 60.0
                ) -> tuple[BatchResult, list]:
        """The prefill batch over ``tasks`` while a thread polls the decode side; the batch's
        result and the notices that arrived (one per task, or what came within ``timeout_s``)."""
        arrived: list = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                arrived.extend(decode_notification(n.payload) for n in self.receiver.poll().notifications)
                time.sleep(0.001)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            result = PrefillBatch(self.pt.agent.name, self.pe, self.sender, self.stats, transfer_timeout_s=20.0,
                                  layerwise=layerwise).run(tasks, {})
            deadline = time.monotonic() + timeout_s
            while len(arrived) < len(tasks) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            poller.join(10)
        return result, arrived

    def hand_over(self, arrived: list) -> dict:
        """Each notice to the decode engine: a done task's first token, a failed one's request
        prefilled locally instead; the notices by request id."""
        by_id = {m.request_id: m for m in arrived}
        for rid, msg in by_id.items():
            if isinstance(msg, PrefillDone):
                self.de.connector.remote_ready(rid, msg.first_token_id, msg.first_token_logprob,
                                               draft_tokens=msg.draft_tokens)
            else:
                self.de.connector.fall_back(rid)
        return by_id

    def decode(self) -> None:
        """Step the decode engine until nothing is left to run."""
        while self.de.has_work():
            self.de.step()

    def outputs(self, n: int, prefix: str = "r") -> list[RequestOutput]:
        """The finished requests ``<prefix>0`` .. ``<prefix><n-1>``, released."""
        return [self.de.release(f"{prefix}{i}") for i in range(n)]

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
            prefix: str = "r") -> list[RequestOutput]:
        """The whole handoff of ``prompts``: every task written, then decoded here."""
        tasks = self.tasks(prompts, params, prefix)
        result, arrived = self.prefill(tasks)
        assert result.failures == [] and result.done == len(tasks), result.failures
        assert all(isinstance(m, PrefillDone) for m in arrived) and len(arrived) == len(tasks)
        self.hand_over(arrived)
        self.decode()
        return self.outputs(len(prompts), prefix)

    def assert_nothing_held(self) -> None:
        assert self.de.kv.num_free_blocks == self.de.runner.num_blocks  # nothing leaked on the decode side
        assert self.pe.kv.num_free_blocks == self.pe.runner.num_blocks  # the prefill side keeps nothing
        for eng in (self.de, self.pe):  # nor in a speculative draft's pool
            draft = eng.spec.draft if eng.spec is not None else None
            assert draft is None or draft.kv.num_free_blocks == draft.kv.pool.num_blocks


@contextmanager
def paired(model: str, tag: str, p_tp: int = 1, d_tp: int = 1, p_args: dict | None = None,
           d_args: dict | None = None, **both: Any) -> Iterator[Pair]:
    """A prefill engine of ``p_tp`` ranks and a decode engine of ``d_tp``, paired (worker ids
    ``p<tag>`` and ``d<tag>``); ``both`` are engine arguments of both sides, ``p_args`` /
    ``d_args`` one side's. Pools of different TP sizes exchange head ranges: HND on both."""
    layout = {"kv_layout": "HND"} if p_tp != d_tp else {}
    with ExitStack() as stack:
        pe = engine(model, p_tp, **{**layout, **both, **(p_args or {})})
        stack.callback(pe.close)
        de = engine(model, d_tp, **{**layout, **both, **(d_args or {})})
        stack.callback(de.close)
        pt = open_worker_transport(f"p{tag}", pe, ucx_env=LOOPBACK_UCX_ENV)
        stack.callback(pt.agent.close)
        dt = open_worker_transport(f"d{tag}", de, ucx_env=LOOPBACK_UCX_ENV)
        stack.callback(dt.agent.close)
        sender = pt.sender()
        yield Pair(pe, de, pt, dt, sender, dt.receiver(), sender.add_peer(dt.record))
