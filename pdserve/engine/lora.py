"""PEFT LoRA adapters: the engine's settings, an adapter read and checked, and the host cache.

An adapter is a PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``) whose
``lora_A``/``lora_B`` weights modify the attention and MLP projections (q, k, v, o, gate, up,
down) of the model's layers; ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). `load_adapter` refuses what the engine does not
implement (DoRA, biases, ``modules_to_save``, per-module ranks, other target modules) and an
adapter whose shapes do not fit the model, with a `LoRAError` naming the field or weight.
`AdapterCache` keeps the most recently used ``max_cpu_loras`` adapters in host memory (whole,
float32); the device slots are engine/lora_layers.py's. docs/lora.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from .config import ConfigError, EngineConfig, ModelConfig
from .lora_request import LoRARequest
from .request import InvalidRequestError

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields whose non-default value asks for what the engine does not do.
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D models) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
}


class LoRAError(InvalidRequestError):
    """An adapter the engine refuses; ``field`` names the setting or weight at fault."""

    def __init__(self, field_name: str, lora: LoRARequest, message: str):
        super().__init__(field_name, f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {message}")


def check_lora_config(cfg: EngineConfig) -> None:
    """The engine's LoRA settings (vLLM's names): `ConfigError` naming the field."""
    if not cfg.enable_lora:
        return
    if not isinstance(cfg.max_lora_rank, int) or cfg.max_lora_rank < 1:
        raise ConfigError(f"max_lora_rank={cfg.max_lora_rank!r} must be an integer >= 1")
    if not isinstance(cfg.max_loras, int) or cfg.max_loras < 1:
        raise ConfigError(f"max_loras={cfg.max_loras!r} must be an integer >= 1 (adapters resident at once)")
    cpu = cfg.max_cpu_loras
    if cpu is not None and (not isinstance(cpu, int) or cpu < cfg.max_loras):
        raise ConfigError(f"max_cpu_loras={cpu!r} must be an integer >= max_loras={cfg.max_loras} (or unset)")


def check_request(lora: object, enabled: bool) -> LoRARequest:
    """A request's ``lora_request``, checked as a value (not yet read from disk)."""
    if not isinstance(lora, LoRARequest):
        raise InvalidRequestError("lora_request", f"must be a LoRARequest, got {type(lora).__name__}")
    if not enabled:
        raise InvalidRequestError("lora_request", "this engine runs without adapters: start it with enable_lora=True")
    if not isinstance(lora.lora_name, str) or not lora.lora_name or "\x00" in lora.lora_name:
        raise InvalidRequestError("lora_request.lora_name", "must be a non-empty string without NUL")
    if not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
        raise InvalidRequestError("lora_request.lora_int_id", f"{lora.lora_int_id!r} must be an integer >= 1")
    if not isinstance(lora.lora_path, str) or not os.path.isdir(lora.lora_path):
        raise InvalidRequestError("lora_request.lora_path", f"{lora.lora_path!r} is not a directory")
    return lora


@dataclass
class Adapter:
    """One adapter in host memory: per (layer, module) its A ``[r, in]`` and B ``[out, r]``."""

    lora: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(lora: LoRARequest) -> dict:
    path = os.path.join(lora.lora_path, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoRAError(CONFIG_FILE, lora, "missing: not a PEFT adapter directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(CONFIG_FILE, lora, f"not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAError(CONFIG_FILE, lora, f"must be a JSON object, got {type(raw).__name__}")
    return raw


def _check_config(lora: LoRARequest, raw: dict, max_rank: int) -> tuple[int, float, set[str] | None]:
    """(rank, scaling, the target modules listed, or None for a pattern) or `LoRAError`."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError("peft_type", lora, f"{raw.get('peft_type')!r}: only LORA adapters are supported")
    for name, why in _REFUSED.items():
        if raw.get(name):
            raise LoRAError(name, lora, why)
    if raw.get("bias", "none") != "none":
        raise LoRAError("bias", lora, f"{raw.get('bias')!r}: only bias='none' is supported")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError("r", lora, f"{r!r} must be an integer >= 1")
    if r > max_rank:
        raise LoRAError("r", lora, f"rank {r} exceeds this engine's max_lora_rank={max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError("lora_alpha", lora, f"{alpha!r} must be a finite number")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError("use_rslora", lora, f"{rslora!r} must be true or false")
    targets = raw.get("target_modules")
    listed: set[str] | None = None
    if isinstance(targets, list):
        if not targets or not all(isinstance(t, str) for t in targets):
            raise LoRAError("target_modules", lora, f"{targets!r} must be a non-empty list of module names")
        listed = {t.rsplit(".", 1)[-1] for t in targets}
        unsupported = sorted(listed - set(MODULES))
        if unsupported:
            raise LoRAError("target_modules", lora, f"{unsupported} not supported; supported: {', '.join(MODULES)}")
    elif not isinstance(targets, str):  # a string is a pattern (or "all-linear"): the weights say which
        raise LoRAError("target_modules", lora, f"{targets!r} must be a list of module names or a pattern")
    return r, alpha / (math.sqrt(r) if rslora else r), listed


def expected_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of one of a layer's projections in the whole (unsharded) model."""
    hd, hidden, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.num_heads * hd, hidden), "k_proj": (cfg.num_kv_heads * hd, hidden),
            "v_proj": (cfg.num_kv_heads * hd, hidden), "o_proj": (hidden, cfg.num_heads * hd),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def _read_weights(lora: LoRARequest, cfg: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    path = os.path.join(lora.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(path):
        why = (" (only adapter_model.bin: pickle files are not loaded; save with safe_serialization=True)"
               if os.path.isfile(os.path.join(lora.lora_path, "adapter_model.bin")) else "")
        raise LoRAError(WEIGHTS_FILE, lora, f"missing{why}")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or m.group(2) not in MODULES:
                    raise LoRAError(key, lora, f"not a LoRA weight of a supported projection ({', '.join(MODULES)})")
                layer, module = int(m.group(1)), m.group(2)
                if layer >= cfg.num_layers:
                    raise LoRAError(key, lora, f"layer {layer}, but the model has {cfg.num_layers} layers "
                                    "(an adapter for another base model?)")
                if cfg.moe is not None and module in MLP_MODULES and cfg.moe.is_sparse(layer):
                    raise LoRAError(key, lora, "LoRA on a mixture-of-experts layer's experts is not supported")
                found.setdefault((layer, module), {})[m.group(3)] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types on a bad file)
        raise LoRAError(WEIGHTS_FILE, lora, f"not a readable safetensors file: {exc}") from None
    return found


def load_adapter(lora: LoRARequest, cfg: ModelConfig, max_rank: int) -> Adapter:
    """Read and check an adapter (whole, float32, in host memory) or raise `LoRAError`."""
    rank, scaling, listed = _check_config(lora, _read_config(lora), max_rank)
    adapter = Adapter(lora, rank, scaling)
    for (layer, module), pair in sorted(_read_weights(lora, cfg).items()):
        key = f"base_model.model.model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{key}.lora_{'B' if 'A' in pair else 'A'}.weight", lora, "missing (A and B come in pairs)")
        if listed is not None and module not in listed:
            raise LoRAError("target_modules", lora, f"{key} has weights but target_modules does not list {module}")
        out_f, in_f = expected_shape(cfg, module)
        a, b = pair["A"], pair["B"]
        for name, t, want in (("A", a, (rank, in_f)), ("B", b, (out_f, rank))):
            if tuple(t.shape) != want:
                raise LoRAError(f"{key}.lora_{name}.weight", lora, f"shape {tuple(t.shape)}, this model and r={rank} "
                                f"need {want} (an adapter for another base model?)")
        adapter.weights[(layer, module)] = (a.to(torch.float32), b.to(torch.float32))
    if not adapter.weights:
        raise LoRAError(WEIGHTS_FILE, lora, "holds no LoRA weights")
    return adapter


class AdapterCache:
    """The adapters in host memory, least recently used dropped past ``capacity``; the names an
    engine has seen, each bound to one (id, path) so that one name never means two adapters."""

    def __init__(self, cfg: ModelConfig, max_rank: int, capacity: int):
        self.cfg, self.max_rank, self.capacity = cfg, max_rank, capacity
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.known: dict[str, LoRARequest] = {}
        self.loads = 0  # reads from disk (tests and stats)

    def check_name(self, lora: LoRARequest) -> None:
        seen = self.known.get(lora.lora_name)
        if seen is not None and seen != lora:
            raise InvalidRequestError("lora_request.lora_name", f"{lora.lora_name!r} already names adapter "
                                      f"{seen.lora_int_id} at {seen.lora_path}; one name is one adapter")
        for other in self.known.values():
            if other.lora_int_id == lora.lora_int_id and other.lora_name != lora.lora_name:
                raise InvalidRequestError("lora_request.lora_int_id", f"{lora.lora_int_id} already belongs to "
                                          f"adapter {other.lora_name!r}")

    def get(self, lora: LoRARequest) -> Adapter:
        """The adapter, read from disk when not held (`LoRAError` when refused)."""
        self.check_name(lora)
        adapter = self.adapters.get(lora.lora_name)
        if adapter is not None:
            self.adapters.move_to_end(lora.lora_name)
            return adapter
        adapter = load_adapter(lora, self.cfg, self.max_rank)
        self.loads += 1
        self.known[lora.lora_name] = lora
        self.adapters[lora.lora_name] = adapter
        while len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)
        return adapter
