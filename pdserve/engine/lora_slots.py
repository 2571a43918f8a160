"""Which adapter each of the ``max_loras`` device slots holds, on every tensor-parallel rank.

`LoRARuntime` is a runner's (engine/runner.py): rank 0 checks a request's adapter when it is
added (read into the host cache, engine/lora.py), and before each step makes every adapter of
the step resident (`prepare`): one already in a slot is used there, another is copied into the
least recently used slot that no row of the step needs, from the host cache (or from disk when
the cache dropped it). At TP>1 rank 0 tells the other ranks to fill the same slot (`TPGroup.call`
``"lora"``, handled by `handle` in engine/tp_rank.py): each reads the adapter from its path and
keeps its own slice. The scheduler admits at most ``max_loras`` distinct adapters among the
running requests (`lora_fits`), so a step's adapters always fit. The step's per-token slot
indices (-1: the base) travel with the step (engine/tp_step.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .config import EngineConfig, ModelConfig
from .lora import AdapterCache, check_request
from .lora_layers import LoRAModel
from .lora_request import LoRARequest
from .tensor_parallel import Shard

if TYPE_CHECKING:
    from .request import Request
    from .tp_group import TPGroup


def lora_fits(lora: LoRARequest | None, running: Iterable[Request], max_loras: int | None) -> bool:
    """Whether a request with adapter ``lora`` may join ``running`` without their distinct
    adapters exceeding ``max_loras`` (None: the engine runs without adapters)."""
    if lora is None or max_loras is None:
        return True
    names = {r.lora_request.lora_name for r in running if r.lora_request is not None}
    return lora.lora_name in names or len(names) < max_loras


class LoRARuntime:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, shard: Shard,
                 device: torch.device, dtype: torch.dtype):
        self.max_loras = cfg.max_loras
        self.cache = AdapterCache(model_cfg, cfg.max_lora_rank, cfg.max_cpu_loras or cfg.max_loras)
        self.model = LoRAModel(model, shard, model_cfg.head_dim, cfg.max_loras, cfg.max_lora_rank, device, dtype)
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, least recently used first
        self.slot_loads = 0  # slots filled (tests and stats)

    def check(self, lora: object) -> LoRARequest:
        """A request's adapter, read and checked (`LoRAError` / `InvalidRequestError` naming the field)."""
        req = check_request(lora, True)
        self.cache.get(req)
        return req

    def prepare(self, scheduled: list[tuple[Request, int]], group: TPGroup | None) -> np.ndarray | None:
        """Make the step's adapters resident; the slot of each of its tokens (None: no adapter)."""
        loras = [r.lora_request for r, _ in scheduled]
        needed = {lora.lora_name: lora for lora in loras if lora is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters; max_loras={self.max_loras}")
        for name in needed:
            if name in self.slots:
                self.slots.move_to_end(name)
        for name, lora in needed.items():
            if name not in self.slots:
                self._place(lora, set(needed), group)
        per_req = np.fromiter((-1 if lora is None else self.slots[lora.lora_name] for lora in loras),
                              dtype=np.int64, count=len(loras))
        return np.repeat(per_req, [n for _, n in scheduled])

    def _place(self, lora: LoRARequest, keep: set[str], group: TPGroup | None) -> None:
        taken = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self.slots if n not in keep)
            slot = self.slots.pop(victim)
        self.slots.pop(lora.lora_name, None)
        self.model.fill(slot, self.cache.get(lora))
        if group is not None:
            group.call("lora", slot=slot, name=lora.lora_name, id=lora.lora_int_id, path=lora.lora_path)
        self.slots[lora.lora_name] = slot
        self.slot_loads += 1

    def handle(self, args: dict) -> dict:
        """Rank > 0: fill ``args['slot']`` with the adapter rank 0 named."""
        lora = LoRARequest(args["name"], int(args["id"]), args["path"])
        self.model.fill(int(args["slot"]), self.cache.get(lora))
        return {}

    def begin_step(self, slots: np.ndarray | None) -> None:
        self.model.begin_step(slots)
