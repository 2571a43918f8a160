"""A worker that can change role in place: prefill <-> decode without reloading its weights.

`FlexWorker` is the entry point the launcher and the planner use when the autoscale policy
allows role flips (`allow_role_flip`). It runs a `PrefillWorker` or a `DecodeWorker` around
one engine it keeps for its whole life. `flip(role, worker_id)` drains the current role
(no new work; in-flight requests or prefill tasks finish; its record leaves etcd), stops that
role's servers, NIXL agent and registration, then starts the other role on the same engine
under a new worker id: a new lease and etcd record, a new NIXL agent over the same KV pool,
and (as decode) new gRPC/HTTP endpoints. Nothing is loaded again.

The engine keeps the arguments of the role it was started in (block size, dtype and KV pool
are the model's; batch limits are that role's). Ray restarts a crashed FlexWorker in its
original role and id, and the planner rebalances from there.

This lives in the composition root because it drives both worker packages (neither may
import the other); the control plane refers to it by name only (`DEFAULT_FLEX_ENTRYPOINT` in
cluster/topology.py, beside the other roles' entry points).
"""

from __future__ import annotations

import logging
import os

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLMEngine
from pdserve.prefill.worker import PrefillWorker

log = logging.getLogger(__name__)

ROLE_CLASSES: dict[str, type[PrefillWorker] | type[DecodeWorker]] = {"prefill": PrefillWorker, "decode": DecodeWorker}


class FlexWorker:
    """`cfg`: {"role": ..., "configs": {"prefill": {...}, "decode": {...}}} where each config
    is what that role's worker takes (cluster.worker_config.launch_config); the current
    role's config names its worker id."""

    def __init__(self, cfg: dict):
        self.role = cfg["role"]
        self.configs = {r: dict(c) for r, c in cfg["configs"].items()}
        self.cfg = WorkerConfig.of({k: v for k, v in self.configs[self.role].items()
                                    if k in WorkerConfig.__dataclass_fields__})
        self.worker: PrefillWorker | DecodeWorker | None = None  # None: not started, or between roles
        self.engine: LLMEngine | None = None  # the one engine every role it serves runs on
        self.flips = 0

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id if self.worker is not None else self.configs[self.role]["worker_id"]

    async def start(self) -> dict:
        cfg = dict(self.configs[self.role],
                   replace_stale_registration=self.cfg.replace_stale_registration)  # set after a Ray restart
        return await self._start_as(self.role, cfg)

    async def _start_as(self, role: str, cfg: dict) -> dict:
        if cfg.get("engine_core_process"):  # (refused before anything starts)
            raise ValueError("engine_core_process: a worker changing role in place keeps its engine in its process")
        worker = ROLE_CLASSES[role](cfg)
        info = await worker.start(engine=self.engine)
        engine = worker.engine
        if not isinstance(engine, LLMEngine):  # (refused at start: decode/worker.py refuse_with_core_process)
            raise ValueError("engine_core_process: a worker changing role in place keeps its engine in its process")
        self.worker, self.role, self.engine = worker, role, engine
        return {**info, "role": role, "worker_id": worker.worker_id, "pid": os.getpid()}

    async def flip(self, role: str, worker_id: str) -> dict:
        """Drain the current role, then serve as `role` under `worker_id` on the same engine."""
        if role not in ROLE_CLASSES:
            raise ValueError(f"role={role!r} must be prefill or decode")
        if role == self.role:
            raise ValueError(f"{self.worker_id} already serves as {role}")
        old = self.worker
        if old is None:
            raise RuntimeError(f"{self.worker_id} is not serving: it cannot change role")
        log.warning("%s: changing role %s -> %s as %s (engine kept)", old.worker_id, self.role, role, worker_id)
        await old.drain()
        if isinstance(old, DecodeWorker):
            await old.stop(close_engine=False)  # the engine serves the next role
        else:
            await old.stop()
        self.worker = None
        cfg = dict(self.configs[role], worker_id=worker_id)
        info = await self._start_as(role, cfg)
        self.flips += 1
        return info

    async def drain(self, *args, **kwargs) -> None:
        if self.worker is not None:
            await self.worker.drain(*args, **kwargs)

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()

    def describe(self) -> dict:
        return {"role": self.role, "worker_id": self.worker_id, "flips": self.flips, "pid": os.getpid()}

    def stats(self) -> dict:
        w = self.worker
        if w is None:
            raise RuntimeError(f"{self.worker_id} is not serving")
        return w.stats() if isinstance(w, DecodeWorker) else w.get_stats()

    def get_stats(self) -> dict:
        return self.stats()

    def pid(self) -> int:
        return os.getpid()
