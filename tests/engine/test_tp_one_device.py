"""Tensor-parallel ranks on chosen CUDA devices (engine arg tp_device_ids): ranks sharing one
device talk over gloo through the host (NCCL takes one device per rank). The choice of the
group's backend and the refusals run on the CPU; the TP=2 engine on one GPU is `gpu`-marked
(bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.tp_group import resolve_comm

from .markers import needs_shm

CUDA = torch.device("cuda")  # (a device object only: nothing here touches a GPU)


def cfg(**args) -> EngineConfig:
    return EngineConfig(model="unused", tensor_parallel_size=2, **args)


@needs_shm
@pytest.mark.parametrize("ids,want,comm", [
    (None, "auto", "nccl"), ([0, 1], "auto", "nccl"), ([0, 0], "auto", "gloo"),
    ([0, 0], "gloo", "gloo"), ([1, 0], "gloo", "gloo"), ([0, 1], "nccl", "nccl"),
])
def test_the_groups_backend_on_a_gpu_follows_the_ranks_devices(ids, want, comm):
    assert resolve_comm(cfg(tp_device_ids=ids, tp_comm=want), CUDA) == comm


@needs_shm
@pytest.mark.parametrize("ids,want,word", [([0, 0], "nccl", "use tp_comm='gloo'"), (None, "shm", "use tp_comm='nccl'")])
def test_backends_that_cannot_run_on_the_devices_are_refused(ids, want, word):
    with pytest.raises(ConfigError, match=word):
        resolve_comm(cfg(tp_device_ids=ids, tp_comm=want), CUDA)


@pytest.mark.parametrize("ids", [[0], [0, 0, 0], [0, -1]])
def test_tp_device_ids_must_name_one_device_per_rank(ids):
    with pytest.raises(ConfigError, match="tp_device_ids"):
        cfg(tp_device_ids=ids).validate()


@pytest.mark.gpu
@needs_shm
def test_tp2_on_one_gpu_gives_the_tokens_of_tp1(model_dirs):
    """Both ranks on cuda:0 (gloo through the host), float32 (the torch attention path): the
    tokens of one rank, greedy; each rank's pool holds its half of the KV heads."""
    prompts = [[3 + (i * 31 + j * 7) % 30000 for j in range(20 + 37 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    args = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=256 << 20)
    one = LLM(model_dirs("llama_gpu"), **args)
    want = [o.token_ids for o in one.generate(prompts, params)]
    two = LLM(model_dirs("llama_gpu"), tensor_parallel_size=2, tp_device_ids=[0, 0], **args)
    try:
        assert two.engine.runner.group.comm.name == "gloo"
        assert two.engine.runner.num_kv_heads * 2 == one.engine.runner.num_kv_heads
        assert [o.token_ids for o in two.generate(prompts, params)] == want
    finally:
        two.engine.close()
