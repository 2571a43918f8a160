"""A worker entry point that serves nothing: it reports where Ray placed it (the placement
group of its ranks, the GPUs its ranks were given), for tests/cluster/test_rank_placement.py."""

from __future__ import annotations

import os


class RankProbe:
    def __init__(self, cfg: dict):
        self.cfg = cfg

    async def start(self) -> dict:
        return self.placement()

    def placement(self) -> dict:
        import ray
        from ray.util.placement_group import get_current_placement_group

        group = get_current_placement_group()
        return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                "group": group.id.hex() if group else None, "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    async def drain(self) -> None:
        return None

    async def stop(self) -> None:
        return None
