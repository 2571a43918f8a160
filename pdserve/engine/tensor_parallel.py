"""How a model splits over the tensor-parallel ranks of one worker (Megatron-style).

Each rank holds (engine/model.py builds the layers from a `Shard`, `load_model` slices the
checkpoint by it):

- attention: its query heads and the KV heads they read (`pdserve.common.heads`: split when
  there are at least as many KV heads as ranks, replicated when fewer); the fused QKV
  projection is column-parallel, ``o_proj`` row-parallel (one all-reduce);
- MLP: a slice of the intermediate rows; gate/up column-parallel, ``down_proj``
  row-parallel (one all-reduce);
- mixture-of-experts layers (engine/moe.py), the router replicated either way:
  tensor-parallel experts, every rank a slice of each expert's intermediate rows
  (``moe_inter``), whose row-parallel outputs meet in the layer's one all-reduce as a dense
  MLP's do; or expert parallel (``enable_expert_parallel``; the CPU's default, `expert_parallel`),
  each rank 1/N of the routed experts whole (``experts``), computing only the (token, expert)
  pairs routed to them, the same one all-reduce summing the ranks' parts (docs/models.md
  measures the two). Shared experts stay tensor-parallel (``shared_inter``);
- embedding and LM head: a slice of the vocabulary (``ceil(vocab / tp)`` rows, the last
  padded with zero rows); the embedding zeroes ids outside its slice and all-reduces, the
  LM head's logits are gathered at rank 0, which samples;
- a row-parallel layer's bias is added by rank 0 only (once in the sum);
- the norms and RoPE tables are replicated.

So a step costs ``2 x layers + 1`` all-reduces of ``[tokens, hidden]`` and one gather of
``[sampled rows, vocab / tp]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.heads import HeadShardingError, check_tp_heads, kv_head_range, q_head_range

from .config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    q_heads: range  # global query heads
    kv_heads: range  # global KV heads (the pool's heads, in order)
    inter: range  # rows of the MLP's intermediate dimension
    vocab: range  # vocabulary rows held (the last rank's may be short)
    vocab_per_rank: int  # rows of every rank's embedding / LM head (padded)
    moe_inter: range = range(0)  # rows of each routed expert's intermediate dimension (MoE models)
    # The routed experts this rank holds: all of them (tensor-parallel experts), or a contiguous
    # 1/N of them whole (expert parallel: enable_expert_parallel; moe_inter is then every row).
    experts: range = range(0)
    shared_inter: range = range(0)  # rows of the shared experts' intermediate dimension (tensor-parallel)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def expert_parallel(cfg: ModelConfig, tp: int, asked: bool | None, device_type: str) -> bool:
    """Whether a mixture-of-experts model's ranks split the experts whole: as ``asked``
    (enable_expert_parallel), or by default on the CPU where ``tp`` divides the routed experts:
    there it measured faster than tensor-parallel experts at decode batches 16 and 64 and level
    at 1 (docs/models.md); on a GPU, tensor-parallel experts (vLLM's default) until measured."""
    if asked is not None:
        return asked
    return cfg.moe is not None and tp > 1 and device_type == "cpu" and cfg.moe.num_experts % tp == 0


def check_tp(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """`ConfigError` naming what to change when the model cannot be split over ``tp`` ranks."""
    try:
        check_tp_heads(cfg.num_heads, cfg.num_kv_heads, tp)
    except HeadShardingError as exc:
        raise ConfigError(f"{exc} (model {cfg.model_id})") from None
    if cfg.has_dense_mlp() and cfg.intermediate_size % tp:
        raise ConfigError(f"tensor_parallel_size={tp} must divide the model's intermediate_size="
                          f"{cfg.intermediate_size} (model {cfg.model_id})")
    if expert_parallel and cfg.moe is not None and cfg.moe.num_experts % tp:
        raise ConfigError(f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's "
                          f"{cfg.moe.num_experts} routed experts (model {cfg.model_id}); set "
                          "enable_expert_parallel=False for tensor-parallel experts")
    needs_rows = cfg.moe is not None and (not expert_parallel or cfg.moe.n_shared_experts)
    if needs_rows and cfg.moe is not None and cfg.moe.intermediate_size % tp:
        what = "intermediate_size" if cfg.architecture == "mixtral" else "moe_intermediate_size"
        raise ConfigError(f"tensor_parallel_size={tp} must divide the model's {what}="
                          f"{cfg.moe.intermediate_size} (each expert's; model {cfg.model_id})")


def make_shard(cfg: ModelConfig, rank: int, tp: int, expert_parallel: bool = False) -> Shard:
    check_tp(cfg, tp, expert_parallel)
    inter = cfg.intermediate_size // tp
    moe_inter = cfg.moe.intermediate_size // tp if cfg.moe is not None else 0
    shared_inter = range(rank * moe_inter, (rank + 1) * moe_inter)
    experts = range(cfg.moe.num_experts) if cfg.moe is not None else range(0)
    routed_inter = shared_inter
    if expert_parallel and cfg.moe is not None:
        per = cfg.moe.num_experts // tp
        experts = range(rank * per, (rank + 1) * per)
        routed_inter = range(cfg.moe.intermediate_size)
    vocab_per = -(-cfg.vocab_size // tp)
    return Shard(
        rank=rank, size=tp,
        q_heads=q_head_range(cfg.num_heads, tp, rank),
        kv_heads=kv_head_range(cfg.num_kv_heads, tp, rank),
        inter=range(rank * inter, (rank + 1) * inter),
        vocab=range(min(rank * vocab_per, cfg.vocab_size), min((rank + 1) * vocab_per, cfg.vocab_size)),
        vocab_per_rank=vocab_per,
        moe_inter=routed_inter, experts=experts, shared_inter=shared_inter,
    )


def whole(cfg: ModelConfig) -> Shard:
    """The single-rank 'shard': everything."""
    return make_shard(cfg, 0, 1)
