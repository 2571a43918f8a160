"""Cost profiles: what one simulated engine step, one KV transfer and one queue hop cost.

A profile is the simulator's ground truth for a kind of worker: the time of a step as a
function of what it runs (per tensor-parallel size), how many KV blocks a worker holds, and
what moving KV between workers costs. The product's own cost model (router/costs.py) never
sees it: it learns its own estimates from the simulated step times, as it does on hardware.

    step ms = fixed_ms + decode_ms_per_seq x decoding streams + prefill_ms_per_token x prompt tokens
              + attention_ms_per_kpair x (prompt token, earlier position) pairs / 1000
              + decode_ms_per_kctx x context tokens of the decoding streams / 1000

(the last term is the KV a decode step reads: it is what makes long contexts slow on a GPU).
A transfer of n tokens' KV costs ``transfer_setup_ms + n x kv_bytes_per_token / bandwidth``,
less the part that overlaps the prefill's compute (``transfer_overlap``: layer-by-layer
streaming). Profiles are measured (`pdserve sim profile`, sim/measure.py) or derived from
published hardware numbers (`roofline`, with every assumption listed in the profile).
Stored as YAML or JSON; `load_profile` checks every field and names the bad one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the field."""


@dataclass(frozen=True, slots=True)
class StepModel:
    """The step time of one worker at one tensor-parallel size (ms)."""

    fixed_ms: float
    decode_ms_per_seq: float
    prefill_ms_per_token: float
    attention_ms_per_kpair: float = 0.0
    decode_ms_per_kctx: float = 0.0
    kv_blocks: int = 4096  # KV blocks of the worker's pool at this size

    def step_ms(self, decodes: int, prompt_tokens: int, pairs: int = 0, context: int = 0) -> float:
        return (self.fixed_ms + self.decode_ms_per_seq * decodes + self.prefill_ms_per_token * prompt_tokens
                + self.attention_ms_per_kpair * pairs / 1e3 + self.decode_ms_per_kctx * context / 1e3)


@dataclass(frozen=True)
class CostProfile:
    """A kind of worker (model x hardware), as the simulator times it."""

    name: str
    source: str  # how it was obtained: "measured: ..." or "roofline: ..."
    kv_bytes_per_token: int
    steps: dict[int, StepModel]  # tensor-parallel size -> its step model
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    transfer_setup_ms: float = 2.0
    transfer_gb_per_s: float = 1.0
    transfer_overlap: float = 0.0  # fraction of the transfer hidden behind the prefill's compute
    queue_hop_ms: float = 2.0  # a task's put, the prefill worker's take, and its decode worker's notice
    # Step-time noise: each step is scaled by a lognormal factor of this coefficient of variation.
    noise_cv: float = 0.0
    # What a served request pays outside the engine (HTTP or gRPC in and out, validation, the
    # stream's first chunk): added to its TTFT. Calibrated on a real run (sim/calibrate.py).
    request_overhead_ms: float = 0.0
    # ... and per prompt token, computed or served from the prefix cache alike (the body's token
    # list parsed and checked, the prompt's blocks hashed for the prefix lookup, each hop a
    # gateway adds): what makes a long prompt behind a cached prefix slower than its short
    # prefill says. Calibrated on a run with prefix hits (sim/calibrate.py); 0 when none.
    request_ms_per_prompt_token: float = 0.0
    # What a decode worker does between two engine steps, per token the first of them emitted
    # (its event loop hands each token to its stream and writes the chunk): the steps' period
    # is the step plus this x its tokens, and the cost model, which times the step alone
    # (decode/async_engine.py), never sees it. Calibrated where the run's engine step times are
    # known (pdserve_engine_step_seconds); 0 otherwise (the steps' scale then carries it).
    stream_gap_ms_per_token: float = 0.0
    # CPU the host spends outside the engine per token streamed (the frontend's chunks; the
    # clients' parsing, on a shared host). While tokens stream at R per second (a 1 s moving
    # average), every step runs 1 + R x this / 1000 times longer: the work takes a core's share
    # and a torch step waits for its slowest thread. Calibrated on a real run; 0 where the host
    # has cores to spare.
    contention_ms_per_token: float = 0.0
    # Whose streams slow a step: "worker" (a decode worker's own; each worker its own host) or
    # "cluster" (every worker shares one host's cores, as on the box the validation runs on).
    contention_scope: str = "worker"
    # Host stalls: moments when everything on the host stops at once (a virtual machine's CPUs
    # held off by its host; measured on this project's box: bench/lag_probe.py, docs/PERFORMANCE.md).
    # They start as a Poisson process of this rate and last a lognormal time of this median and
    # sigma; every event due during one (steps ending, arrivals, tokens) happens that much later.
    # Calibrated from a real run's token times (sim/calibrate.py `host_stalls`); 0: none.
    stall_rate_per_s: float = 0.0
    stall_median_ms: float = 0.0
    stall_sigma: float = 0.0
    # A prefill worker's batch budget: the prompt tokens one get_batch may take (prefill/worker.py
    # batch_max_tokens, the topology's queue.batch_max_tokens); 0: its engine's
    # max_num_batched_tokens, as the worker's own default. Above the engine's step budget, a
    # batch of several prompts takes several steps, and each prompt's KV goes out after the
    # step its prefill ends in (prefill/batch.py push_as_computed).
    batch_max_tokens: int = 0
    # The second KV tier (engine/kv_tier.py; an engine's kv_offload_bytes): this many whole
    # blocks per worker (0: none), loaded back at this many GB/s per tensor-parallel rank. The
    # product copies blocks ahead of their eviction off the engine's steps: not timed here.
    tier_blocks: int = 0
    tier_gb_per_s: float = 10.0
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    def step(self, tp: int) -> StepModel:
        try:
            return self.steps[tp]
        except KeyError:
            raise ProfileError(f"profile {self.name!r} has no step model for tensor_parallel_size {tp} "
                               f"(it has {sorted(self.steps)}); measure or derive one") from None

    def transfer_ms(self, tokens: int, compute_ms: float = 0.0) -> float:
        """Moving ``tokens`` positions' KV after a prefill that computed for ``compute_ms``."""
        wire = tokens * self.kv_bytes_per_token / (self.transfer_gb_per_s * 1e6)
        hidden = min(wire, compute_ms) * self.transfer_overlap
        return self.transfer_setup_ms + wire - hidden

    @property
    def prefill_batch_tokens(self) -> int:
        """What one prefill batch may hold (``batch_max_tokens``, else the step budget)."""
        return self.batch_max_tokens or self.max_num_batched_tokens

    def with_noise(self, cv: float) -> CostProfile:
        return replace(self, noise_cv=cv)

    # -- files ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        body = asdict(self)
        body["steps"] = {int(k): asdict(v) for k, v in self.steps.items()}
        body["assumptions"] = list(self.assumptions)
        return body

    def save(self, path: str | Path) -> None:
        path = Path(path)
        body = self.to_dict()
        text = json.dumps(body, indent=2) if path.suffix == ".json" else yaml.safe_dump(body, sort_keys=False)
        path.write_text(text)


_POSITIVE = ("kv_bytes_per_token", "block_size", "max_num_batched_tokens", "max_num_seqs", "transfer_gb_per_s",
             "tier_gb_per_s")
SCOPES = ("worker", "cluster")
_NON_NEGATIVE = ("transfer_setup_ms", "queue_hop_ms", "noise_cv", "request_overhead_ms",
                 "request_ms_per_prompt_token", "stream_gap_ms_per_token", "contention_ms_per_token",
                 "stall_rate_per_s", "stall_median_ms", "stall_sigma", "batch_max_tokens", "tier_blocks")
_COUNTS = ("batch_max_tokens", "tier_blocks")  # whole numbers


def profile_from_dict(body: dict, source: str = "<profile>") -> CostProfile:
    """A checked profile from its dict form (ProfileError names the bad field)."""
    if not isinstance(body, dict):
        raise ProfileError(f"{source}: a profile is a mapping, got {type(body).__name__}")
    known = set(CostProfile.__dataclass_fields__)
    unknown = sorted(set(body) - known)
    if unknown:
        raise ProfileError(f"{source}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
    for name in ("name", "kv_bytes_per_token", "steps"):
        if name not in body:
            raise ProfileError(f"{source}: missing field {name!r}")
    for name in _POSITIVE + _NON_NEGATIVE + ("transfer_overlap",):
        if name in body:
            v = body[name]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ProfileError(f"{source}: {name} must be a number, got {v!r}")
            if (name in _POSITIVE and v <= 0) or v < 0:
                raise ProfileError(f"{source}: {name} must be {'> 0' if name in _POSITIVE else '>= 0'}, got {v!r}")
            if name in _COUNTS and v != int(v):
                raise ProfileError(f"{source}: {name} must be a whole number, got {v!r}")
    if body.get("contention_scope", "worker") not in SCOPES:
        raise ProfileError(f"{source}: contention_scope must be one of {', '.join(SCOPES)}, "
                           f"got {body['contention_scope']!r}")
    if not 0 <= body.get("transfer_overlap", 0.0) <= 1:
        raise ProfileError(f"{source}: transfer_overlap must be in [0, 1], got {body['transfer_overlap']!r}")
    steps_in = body["steps"]
    if not isinstance(steps_in, dict) or not steps_in:
        raise ProfileError(f"{source}: steps must map tensor-parallel sizes to step models")
    steps = {}
    for k, v in steps_in.items():
        try:
            tp = int(k)
        except (TypeError, ValueError):
            raise ProfileError(f"{source}: steps key {k!r} is not a tensor-parallel size") from None
        if tp < 1 or not isinstance(v, dict):
            raise ProfileError(f"{source}: steps.{k} must be a mapping for a size >= 1")
        bad = sorted(set(v) - set(StepModel.__dataclass_fields__))
        if bad:
            raise ProfileError(f"{source}: steps.{k}: unknown field {bad[0]!r}")
        try:
            model = StepModel(**v)
        except TypeError as exc:
            raise ProfileError(f"{source}: steps.{k}: {exc}") from None
        for name, value in asdict(model).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ProfileError(f"{source}: steps.{k}.{name} must be a number >= 0, got {value!r}")
        if model.prefill_ms_per_token <= 0 or model.kv_blocks < 1:
            raise ProfileError(f"{source}: steps.{k}: prefill_ms_per_token must be > 0 and kv_blocks >= 1")
        steps[tp] = model
    fields = dict(body, steps=steps, assumptions=tuple(body.get("assumptions") or ()))
    fields.update({name: int(body[name]) for name in _COUNTS if name in body})
    fields.setdefault("source", source)
    return CostProfile(**fields)


def load_profile(path: str | Path) -> CostProfile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile: {exc.strerror}") from None
    try:
        body = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    return profile_from_dict(body, str(path))


# -- published hardware and models: the roofline ----------------------------------------------
@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_gb_per_s: float
    dense_tflops: float  # bf16 dense
    memory_gb: float
    link_gb_per_s: float  # between GPUs of one node (NVLink), one direction
    nic_gb_per_s: float  # between nodes (RDMA), per GPU


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_b: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS = {
    # NVIDIA's H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16, 80 GB, NVLink 900 GB/s
    # (both directions); a 400 Gb/s NIC per GPU.
    "h100": Gpu("H100 SXM", 3350.0, 989.0, 80.0, 450.0, 50.0),
    # H200: 4.8 TB/s HBM3e, 141 GB, the same compute and links.
    "h200": Gpu("H200 SXM", 4800.0, 989.0, 141.0, 450.0, 50.0),
}
MODELS = {
    # Llama-3-70B's config: 80 layers, hidden 8192, 8 KV heads of 128 (GQA).
    "llama-3-70b": ModelShape("Llama-3-70B", 70.6, 80, 8192, 8, 128),
    "llama-3-8b": ModelShape("Llama-3-8B", 8.0, 32, 4096, 8, 128),
    # Llama-3.2-1B: 16 layers, hidden 2048, 8 KV heads of 64 (the shape bench/gpu_step.py and
    # bench/gpu_check.sh measure on a lent GPU).
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 1.24, 16, 2048, 8, 64),
}

MFU = 0.5  # fraction of peak FLOP/s a prefill reaches
MBU = 0.7  # fraction of peak HBM bandwidth a decode step reaches
STEP_OVERHEAD_MS = 3.0  # scheduling and launches per step (CUDA graphs for decode)
ALLREDUCE_LATENCY_US = 15.0  # one NVLink all-reduce of a step's activations, latency part
MEMORY_UTILIZATION = 0.9  # of each GPU's memory, for weights and the KV pool


def roofline(model: ModelShape, gpu: Gpu, tps: tuple[int, ...] = (1, 2, 4, 8), *,
             block_size: int = 16, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> CostProfile:
    """A profile from published numbers: weights read once per step (HBM), prompt tokens at
    ``MFU`` of peak FLOP/s, decode KV reads at ``MBU`` of HBM bandwidth, two all-reduces per
    layer under tensor parallelism, KV over the NIC between workers. Sizes whose weights do
    not fit are left out. Every assumption is listed in the profile."""
    flops_per_ms = gpu.dense_tflops * 1e9 * MFU  # FLOP per ms
    hbm_per_ms = gpu.hbm_gb_per_s * 1e6 * MBU  # bytes per ms
    link_per_ms = gpu.link_gb_per_s * 1e6
    weights = model.params_b * 1e9 * model.dtype_bytes
    steps = {}
    for tp in tps:
        room = gpu.memory_gb * 1e9 * tp * MEMORY_UTILIZATION - weights
        if room <= 0:
            continue
        comm_token = 0.0 if tp == 1 else 2 * model.layers * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp \
            / link_per_ms  # ring all-reduce moves 2(tp-1)/tp of the data, twice per layer
        comm_fixed = 0.0 if tp == 1 else 2 * model.layers * ALLREDUCE_LATENCY_US / 1e3
        per_token = 2 * model.params_b * 1e9 / tp / flops_per_ms
        steps[tp] = StepModel(
            fixed_ms=round(STEP_OVERHEAD_MS + weights / tp / hbm_per_ms + comm_fixed, 4),
            decode_ms_per_seq=round(per_token + comm_token, 6),
            prefill_ms_per_token=round(per_token + comm_token, 6),
            # QK^T and AV: 2 x 2 x hidden FLOP per layer for each (token, earlier position) pair
            attention_ms_per_kpair=round(4 * model.hidden * model.layers / tp / flops_per_ms * 1e3, 6),
            decode_ms_per_kctx=round(model.kv_bytes_per_token / tp / hbm_per_ms * 1e3, 6),
            kv_blocks=int(room / model.kv_bytes_per_token // block_size),
        )
    if not steps:
        raise ProfileError(f"{model.name} does not fit on {max(tps)} x {gpu.name} at any size given")
    return CostProfile(
        name=f"{model.name} on {gpu.name}", source=f"roofline: {gpu.name} datasheet, {model.name} config",
        kv_bytes_per_token=model.kv_bytes_per_token, steps=steps, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        transfer_setup_ms=1.0, transfer_gb_per_s=gpu.nic_gb_per_s, transfer_overlap=0.8, queue_hop_ms=2.0,
        noise_cv=0.05,
        assumptions=(
            f"{gpu.name}: {gpu.hbm_gb_per_s:g} GB/s HBM, {gpu.dense_tflops:g} TFLOP/s dense bf16, "
            f"{gpu.memory_gb:g} GB, {gpu.link_gb_per_s:g} GB/s NVLink per direction, {gpu.nic_gb_per_s:g} GB/s NIC",
            f"{model.name}: {model.params_b:g}B parameters, {model.layers} layers, hidden {model.hidden}, "
            f"{model.kv_heads} KV heads x {model.head_dim}, {model.dtype_bytes}-byte weights and KV "
            f"({model.kv_bytes_per_token} KV bytes per token)",
            f"prefill at {MFU:.0%} of peak FLOP/s (2 x parameters FLOP per token, 4 x hidden x layers per "
            "attention pair); decode steps read the weights and the batch's KV at "
            f"{MBU:.0%} of peak HBM bandwidth",
            f"{STEP_OVERHEAD_MS:g} ms of scheduling and launches per step; tensor parallelism adds two ring "
            f"all-reduces per layer ({ALLREDUCE_LATENCY_US:g} us each plus the bytes over NVLink)",
            f"{MEMORY_UTILIZATION:.0%} of GPU memory for weights and KV; the KV pool is what the weights leave",
            "KV between workers over the NIC: 1 ms setup, 80 % of it hidden behind the prefill (layer-wise "
            "streaming); 2 ms per queue hop; 5 % step-time noise",
        ),
    )
