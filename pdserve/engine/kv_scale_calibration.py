"""Computed FP8 KV scales (engine argument ``calculate_kv_scales``; engine/kv_scales.py).

One forward of a fixed calibration sequence runs when the runner has its pool, before the engine
serves: every layer's K and V are recorded (their largest magnitude per KV head) and stored at
the unit scale, while attention reads the exact values, so later layers see what an unquantized
pool would give. Tensor-parallel ranks run it together (it is a normal forward, with the
collectives of any step) and then share their heads' maxima, so every rank, and every worker of
the same model, ends with the same scales for the model's heads. The pool is cleared afterwards.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention_base import BatchLayout
from .config_base import ConfigError
from .kv_quant import FP8_MAX, KVQuant
from .kv_scales import calibration_ids, scales_from_amax
from .step_batch import StepBatch

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .runner import ModelRunner

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512


def calibration_batch(vocab_size: int, n: int, block_size: int, device: torch.device) -> StepBatch:
    """One fresh sequence of ``n`` calibration tokens in blocks 0, 1, ... of the pool."""
    blocks = -(-n // block_size)
    layout = BatchLayout(
        query_start_loc=np.array([0, n], dtype=np.int64), context_lens=np.zeros(1, dtype=np.int64),
        block_tables=np.arange(blocks, dtype=np.int64)[None, :],
        slot_mapping=torch.arange(n, device=device), block_size=block_size,
    )
    return StepBatch(input_ids=calibration_ids(vocab_size, n).to(device), positions=torch.arange(n, device=device),
                     layout=layout, logits_indices=torch.tensor([n - 1], device=device), sampling=[])


def calibrate_kv_scales(runner: ModelRunner, cfg: EngineConfig) -> KVQuant:
    """Compute the runner's FP8 scales from one calibration forward; returns its `KVQuant`."""
    quant = runner.kv_quant
    assert quant is not None
    m = runner.model_cfg
    n = min(CALIBRATION_TOKENS, m.max_position_embeddings)
    if runner.num_blocks * runner.block_size < n:
        raise ConfigError(f"calculate_kv_scales: the calibration runs {n} tokens, and the KV pool holds "
                          f"{runner.num_blocks * runner.block_size}; give the pool more blocks or set "
                          "calculate_kv_scales=False")
    quant.observe(m.num_layers)
    try:
        with torch.inference_mode():
            runner.run_step(calibration_batch(m.vocab_size, n, runner.block_size, runner.device))
        assert quant.observed is not None
        local = quant.observed
    finally:
        quant.observed = None
    amax = torch.zeros(m.num_layers, 2, m.num_kv_heads, dtype=torch.float32)
    amax[:, :, quant.heads.start:quant.heads.stop] = local
    if runner.ctrl is not None:
        gathered = runner.ctrl.gather(amax)
        if gathered:
            amax = torch.stack(list(gathered)).amax(dim=0)
        amax = runner.ctrl.broadcast_(amax.contiguous())
    scales = scales_from_amax(amax, FP8_MAX[quant.storage], cfg.kv_scale_granularity)
    quant.set_scales(scales)
    runner.kv_cache.zero_()
    log.info("KV scales computed from %d calibration tokens (per %s): K %.3g..%.3g, V %.3g..%.3g "
             "(largest |K| %.3g, |V| %.3g)", n, cfg.kv_scale_granularity, float(scales[:, 0].min()),
             float(scales[:, 0].max()), float(scales[:, 1].min()), float(scales[:, 1].max()),
             float(amax[:, 0].max()), float(amax[:, 1].max()))
    return quant
