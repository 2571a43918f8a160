"""Mixture-of-experts MLP layers (Qwen3-MoE, Mixtral): the router, the experts, their weights.

One `SparseMoE` replaces a layer's dense MLP. Its numerics are HF `transformers`' step for step
(greedy output equals HF's in float32, tests/engine/test_model_families.py):

- router: ``logits = h @ gate.T``; softmax over all experts in float32, the top ``top_k``,
  renormalised to sum 1 when ``norm_topk_prob`` (Mixtral always: the same as a softmax over
  the top-k logits). Qwen3-MoE casts the weights to the model's dtype, Mixtral keeps them in
  float32 (`MoEConfig.weights_float32`);
- each selected expert computes ``down(silu(gate(h)) * up(h))``, scaled by its weight; a
  token's ``top_k`` contributions are summed in its top-k order (HF's grouped path).

How the experts run: the ``tokens x top_k`` (token, expert) pairs are sorted by expert id,
the hidden rows gathered in that order, and each expert multiplies all of its rows at once:

- ``loop`` (CPU, and any device without grouped GEMM): one matmul per active expert, each an
  ``nn.Linear`` so `engine/linear.py` packs it for oneDNN like every other weight; one host
  sync per layer to read the per-expert counts;
- ``grouped`` (CUDA): ``torch.nn.functional.grouped_mm`` over the experts' weights stacked
  ``[E, 2I, H]`` / ``[E, H, I]`` (the per-expert linears are views into the stack, so nothing
  is held twice) with the offsets on the device: two kernels a layer and no host sync, so a
  decode step can be captured in a CUDA graph. Chosen at load time by a trial call
  (`stack_for_grouped_mm`); where it fails, ``loop``.

Tensor parallelism (engine/tensor_parallel.py): tensor-parallel experts, or expert parallel
(the CPU's default where the ranks divide the experts). Tensor-parallel experts: every rank
holds every expert's slice ``shard.moe_inter`` of the intermediate rows and the whole router, so
every rank routes alike (bit-identical hidden states) and its partial sum joins the layer's one
all-reduce. Expert parallel (``enable_expert_parallel``): every rank holds the router and
``shard.experts``, 1/N of the experts whole; it computes the pairs routed to those and leaves
the others' rows zero, and the same all-reduce adds the ranks' parts.

Checkpoints: `load_experts` reads the per-expert form the hub and transformers 5's
``save_pretrained`` write (Qwen3-MoE ``mlp.experts.N.{gate,up,down}_proj``, Mixtral
``block_sparse_moe.experts.N.w{1,3,2}``) and the fused form of transformers 5's modules
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``).

DeepSeek-V3 (``MoEConfig.scoring == "sigmoid"``) routes by `route_grouped` with its router's
weight and ``e_score_correction_bias`` held in float32 (HF keeps both in float32), and adds a
shared MLP of ``n_shared_experts * moe_intermediate_size`` rows (`SharedMLP`, tensor-parallel
like a dense MLP) to the routed experts' sum.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, MoEConfig

Take = Callable[[str], torch.Tensor]
Put = Callable[[torch.Tensor, torch.Tensor, str], None]


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert ids)``, both ``[tokens, top_k]``, from the router's logits."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    if not moe.weights_float32:
        weights = weights.to(logits.dtype)
    return weights, ids


def route_grouped(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router, as HF's ``DeepseekV3TopkRouter``: ``(float32 weights, expert ids)``.

    Sigmoid scores of float32 logits; the correction ``bias`` is added only to choose: each group
    scores by its two best, the top ``topk_group`` groups stay, the top ``top_k`` of their experts
    are taken; their weights are the plain scores, renormalised when ``norm_topk_prob``, times
    ``routed_scaling_factor``."""
    scores = F.linear(h.float(), weight).sigmoid()
    choice = scores + bias
    per = moe.num_experts // moe.n_group
    group_scores = choice.view(-1, moe.n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
    keep = keep.unsqueeze(-1).expand(-1, moe.n_group, per).reshape(-1, moe.num_experts)
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * moe.routed_scaling_factor, ids


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [S, K]`` rows grouped by ``offs`` (int32 ends) times ``w [E, K, N]`` per group."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


class Experts(nn.Module):
    """The experts of one layer this rank holds (``local``: all of them, each a slice of its rows,
    or under expert parallelism a contiguous range of them, whole): ``gate_up[j]`` ``[2I, H]``
    (gate rows then up rows) and ``down[j]`` ``[H, I]`` of expert ``local[j]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, local: range | None = None):
        super().__init__()
        self.num_experts = num_experts  # the model's routed experts
        self.local = range(num_experts) if local is None else local
        self.gate_up = nn.ModuleList(nn.Linear(hidden, 2 * inter, bias=False) for _ in self.local)
        self.down = nn.ModuleList(nn.Linear(inter, hidden, bias=False) for _ in self.local)
        self.w13: torch.Tensor | None = None  # [E, 2I, H] when the grouped path is on
        self.w2: torch.Tensor | None = None  # [E, H, I]

    @property
    def path(self) -> str:
        return "grouped" if self.w13 is not None else "loop"

    def stack_for_grouped_mm(self) -> bool:
        """Stack the weights for grouped GEMM, the linears becoming views of the stack; keep
        it when a trial call runs and agrees with the loop (True), else stay on the loop."""
        if not grouped_mm_available() or len(self.local) != self.num_experts:
            return False  # (expert parallel: the loop over this rank's experts)
        gate_up = [lin.weight for lin in self.gate_up]
        down = [lin.weight for lin in self.down]
        if not all(isinstance(w, nn.Parameter) for w in gate_up + down):
            return False  # already packed (oneDNN): the loop's
        w13, w2 = torch.stack([w.detach() for w in gate_up]), torch.stack([w.detach() for w in down])
        try:
            x = torch.randn(2, w13.shape[2], dtype=w13.dtype, device=w13.device) * 0.02
            last = self.num_experts - 1  # row 0 to expert 0, row 1 to the last expert
            offs = torch.tensor([1] * last + [2], dtype=torch.int32, device=w13.device)
            got = _grouped_mm(x, w13.transpose(1, 2), offs)
            want = torch.stack([x[0] @ w13[0].T, x[1] @ w13[last].T])
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-3):
                return False
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        self.w13, self.w2 = w13, w2
        with torch.no_grad():
            for e in range(self.num_experts):
                self.gate_up[e].weight = nn.Parameter(w13[e], requires_grad=False)
                self.down[e].weight = nn.Parameter(w2[e], requires_grad=False)
        return True

    def forward(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)
        x = h.index_select(0, order // k)  # [t * k, H], grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        if self.w13 is not None and self.w2 is not None:
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = _grouped_mm(x, self.w13.transpose(1, 2), offs).chunk(2, dim=-1)
            y = _grouped_mm(F.silu(gate).mul_(up), self.w2.transpose(1, 2), offs)
        else:
            if h.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ConfigError("cuda_graphs=True with a mixture-of-experts model needs grouped GEMM "
                                  "(torch.nn.functional.grouped_mm), which this torch or GPU lacks; "
                                  "set cuda_graphs=False")
            # This rank's experts' rows (all rows unless expert parallel: the others' stay zero,
            # their experts' ranks add them in the layer's all-reduce).
            every = len(self.local) == self.num_experts
            y = torch.empty_like(x) if every else torch.zeros_like(x)
            per_expert = counts.tolist()
            start = sum(per_expert[:self.local.start])
            for j, e in enumerate(self.local):
                n = per_expert[e]
                if n:
                    gate, up = self.gate_up[j](x[start:start + n]).chunk(2, dim=-1)
                    y[start:start + n] = self.down[j](F.silu(gate, inplace=True).mul_(up))
                    start += n
        # Scale by the routing weight (Mixtral's float32 weights promote, as HF's do), put the
        # rows back in (token, slot) order and sum each token's top_k slots.
        scaled = y * weights.reshape(-1).index_select(0, order)[:, None]
        back = torch.empty_like(scaled).index_copy_(0, order, scaled)
        return back.view(t, k, -1).sum(dim=1).to(h.dtype)


class GroupedRouter(nn.Module):
    """DeepSeek-V3's router weights, float32 whatever the model's dtype (not an ``nn.Linear``, so
    nothing packs or casts it): ``weight`` ``[E, H]`` and ``e_score_correction_bias`` ``[E]``."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def set_float32(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        self.weight = nn.Parameter(weight.to(self.weight.device, torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(bias.to(self.weight.device, torch.float32), requires_grad=False)


class SharedMLP(nn.Module):
    """DeepSeek's shared experts: one SiLU-gated MLP every token runs (this rank's rows)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class SparseMoE(nn.Module):
    """A layer's MoE MLP: router and experts (and DeepSeek's shared MLP); returns this rank's
    partial sum."""

    def __init__(self, hidden: int, moe: MoEConfig, inter_per_rank: int, experts: range | None = None,
                 shared_inter_per_rank: int | None = None):
        super().__init__()
        self.moe = moe
        self.gate: nn.Module = (GroupedRouter(hidden, moe.num_experts) if moe.scoring == "sigmoid"
                                else nn.Linear(hidden, moe.num_experts, bias=False))
        self.experts = Experts(moe.num_experts, hidden, inter_per_rank, experts)
        shared = inter_per_rank if shared_inter_per_rank is None else shared_inter_per_rank
        self.shared = SharedMLP(hidden, moe.n_shared_experts * shared) if moe.n_shared_experts else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate, GroupedRouter):
            weights, ids = route_grouped(h, self.gate.weight, self.gate.e_score_correction_bias, self.moe)
        else:
            weights, ids = route(self.gate(h), self.moe)
        out = self.experts(h, weights, ids)
        if self.shared is not None:
            out.add_(self.shared(h))
        return out


# The names a layer's MoE weights go by: (block, gate, up, down) of the per-expert form.
_PER_EXPERT_NAMES = (("mlp", "gate_proj", "up_proj", "down_proj"),
                     ("block_sparse_moe", "w1", "w3", "w2"),
                     ("mlp", "w1", "w3", "w2"))


def load_experts(layer: SparseMoE, prefix: str, names: Container[str], take: Take, put: Put,
                 inter: range, shared_inter: range | None = None) -> None:
    """Load one layer's router and this rank's experts (``layer.experts.local``), rows ``inter``
    of each (and rows ``shared_inter`` of the shared experts). ``names``: the checkpoint's weight
    names not yet taken; ``take`` pops one (a `ConfigError` naming it when missing), ``put``
    copies into a parameter after checking its shape."""
    experts = layer.experts
    n = experts.num_experts
    block = next((b for b in ("mlp", "block_sparse_moe") if f"{prefix}{b}.gate.weight" in names), "mlp")
    if isinstance(layer.gate, GroupedRouter):
        _load_grouped_router(layer, prefix, names, take, put, inter if shared_inter is None else shared_inter)
    else:
        put(layer.gate.weight, take(f"{prefix}{block}.gate.weight"), f"{prefix}{block}.gate.weight")
    fused = f"{prefix}{block}.experts.gate_up_proj"
    if fused in names:
        gate_up, down = take(fused), take(f"{prefix}{block}.experts.down_proj")
        for name, w in ((fused, gate_up), (f"{prefix}{block}.experts.down_proj", down)):
            if w.dim() != 3 or w.shape[0] != n:
                raise ConfigError(f"weight {name} has shape {tuple(w.shape)}; expected [{n} experts, "
                                  "rows, columns] (config.json's expert count)")
        full = gate_up.shape[1] // 2
        for j, e in enumerate(experts.local):
            rows = torch.cat([gate_up[e, inter.start:inter.stop], gate_up[e, full + inter.start:full + inter.stop]])
            put(experts.gate_up[j].weight, rows, f"{fused}[{e}]")
            put(experts.down[j].weight, down[e][:, inter.start:inter.stop], f"{prefix}{block}.experts.down_proj[{e}]")
        return
    form = next(((b, g, u, d) for b, g, u, d in _PER_EXPERT_NAMES
                 if f"{prefix}{b}.experts.0.{g}.weight" in names), _PER_EXPERT_NAMES[0])
    b, g, u, d = form
    for e in range(n):
        p = f"{prefix}{b}.experts.{e}."
        gate, up, down_w = take(f"{p}{g}.weight"), take(f"{p}{u}.weight"), take(f"{p}{d}.weight")
        if e not in experts.local:
            continue  # another rank's expert (expert parallel)
        j = e - experts.local.start
        put(experts.gate_up[j].weight, torch.cat([gate[inter.start:inter.stop], up[inter.start:inter.stop]]),
            f"{p}{g}+{u}")
        put(experts.down[j].weight, down_w[:, inter.start:inter.stop], f"{p}{d}.weight")


def _load_grouped_router(layer: SparseMoE, prefix: str, names: Container[str], take: Take, put: Put,
                         inter: range) -> None:
    """DeepSeek-V3's router (float32) and shared experts (this rank's rows ``n_shared x inter``)."""
    assert isinstance(layer.gate, GroupedRouter)
    n, hidden = layer.gate.weight.shape
    weight = take(f"{prefix}mlp.gate.weight")
    bias_name = f"{prefix}mlp.gate.e_score_correction_bias"
    bias = take(bias_name) if bias_name in names else torch.zeros(n)
    for name, w, shape in ((f"{prefix}mlp.gate.weight", weight, (n, hidden)), (bias_name, bias, (n,))):
        if tuple(w.shape) != shape:
            raise ConfigError(f"weight {name} has shape {tuple(w.shape)}, config.json implies {shape}")
    layer.gate.set_float32(weight, bias)
    if layer.shared is None:
        return
    k = layer.moe.n_shared_experts
    rows = slice(k * inter.start, k * inter.stop)
    p = f"{prefix}mlp.shared_experts."
    gate, up, down = take(p + "gate_proj.weight"), take(p + "up_proj.weight"), take(p + "down_proj.weight")
    put(layer.shared.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]), p + "gate_proj+up_proj")
    put(layer.shared.down_proj.weight, down[:, rows], p + "down_proj.weight")
