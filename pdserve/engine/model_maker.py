"""Write a small random-weight model of a supported family (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral, DeepSeek-V3) with a real tokenizer.

No model hub is needed: the weights come from a seeded random init in HF
`transformers` (so its format is exactly what HF loads), and the tokenizer is
the Mistral-7B SentencePiece model shipped inside the `mistral-common` wheel,
converted to `tokenizer.json`. Same arguments + same seed = same files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

# A Mistral-instruct style template, so /v1/chat/completions works on made models; with tools,
# Hermes-style tool calling (the tools listed first, calls as <tool_call>{"name", "arguments"}
# </tool_call>, results as <tool_response>), so the whole tool path runs on them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<tools>\n' }}{% for tool in tools %}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nTo call functions, answer <tool_call>{\"name\": <function name>, \"arguments\": "
    "<arguments object>}</tool_call> for each call.\n\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '</tool_call>' }}{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '[INST] <tool_response>' + message['content'] + '</tool_response> [/INST]' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


@dataclass
class ModelSpec:
    """Shape of the model to make; defaults give a ~34M-parameter Llama with GQA."""

    arch: str = "llama"  # one of FAMILIES
    num_layers: int = 6
    hidden_size: int = 384
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_type: str = "default"  # default | llama3
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    seed: int = 0
    dtype: str = "float32"
    # Qwen3 / Qwen3-MoE / Mixtral: the head dim (0: hidden_size / num_heads).
    head_dim: int = 0
    # Mixture-of-experts families: experts, experts per token, each expert's intermediate size
    # (Qwen3-MoE; Mixtral's experts use intermediate_size), Qwen3-MoE's norm_topk_prob and its
    # dense layers (mlp_only_layers, of intermediate_size).
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    # DeepSeek-V3: latent attention (q_lora_rank 0: no query compression, q_proj), its experts'
    # groups and shared experts, its leading dense layers; rope_type may be yarn.
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_interleave: bool = True
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)  # a list from YAML or JSON

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def validate(self) -> None:
        if self.arch not in FAMILIES:
            raise ValueError(f"arch={self.arch!r}; use one of {', '.join(FAMILIES)}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.head_dim and self.arch not in ("qwen3", "qwen3_moe", "mixtral"):
            raise ValueError(f"head_dim={self.head_dim}: only qwen3, qwen3_moe and mixtral take a head dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_size % 2 or self.head_dim < 0:
            raise ValueError("the head dim (head_dim, or hidden_size / num_heads) must be even for RoPE")
        if self.rope_type not in ("default", "llama3", "yarn"):
            raise ValueError(f"rope_type={self.rope_type!r}; use default, llama3 or yarn (deepseek_v3)")
        if self.arch == "deepseek_v3":
            self._validate_deepseek()
        elif self.rope_type == "yarn":
            raise ValueError("rope_type='yarn': only deepseek_v3 takes yarn")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)} must be layer indices in [0, {self.num_layers})")
        if self.mlp_only_layers and self.arch != "qwen3_moe":
            raise ValueError("mlp_only_layers: only qwen3_moe has dense layers among its expert layers")

    def _validate_deepseek(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.q_lora_rank < 0 or self.n_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("q_lora_rank, n_shared_experts and first_k_dense_replace must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        per = self.num_experts // self.n_group
        if self.num_experts % self.n_group or per < 2:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} into groups of >= 2")
        if self.topk_group > self.n_group or self.num_experts_per_tok > self.topk_group * per:
            raise ValueError(f"topk_group={self.topk_group} of n_group={self.n_group} groups must hold "
                             f"num_experts_per_tok={self.num_experts_per_tok} experts")

    def tag_fields(self) -> dict:
        """The fields naming a made model's directory (`cached_model`): a field added after the
        first models were cached counts only where it differs from its default, so the
        directories of those models keep their names."""
        defaults = ModelSpec()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()
                if k not in _LATER_FIELDS or getattr(defaults, k) != v}


_LATER_FIELDS = ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "mlp_only_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "rope_interleave", "n_group", "topk_group", "n_shared_experts",
                 "first_k_dense_replace", "routed_scaling_factor")


def tokenizer_source() -> str:
    """Path of the SentencePiece model inside the installed mistral-common wheel."""
    try:
        import mistral_common
    except ImportError as exc:
        raise RuntimeError("make-model needs the `mistral-common` package for its tokenizer") from exc
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(path):
        raise RuntimeError(f"mistral-common has no {path}; reinstall mistral-common")
    return path


def write_tokenizer(out_dir: str) -> int:
    """Convert the Mistral SentencePiece model to tokenizer.json in ``out_dir``; return vocab size."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(tokenizer_source(), os.path.join(tmp, "tokenizer.model"))
        LlamaTokenizer.from_pretrained(tmp).save_pretrained(out_dir)
    tk_path = os.path.join(out_dir, "tokenizer.json")
    tk = Tokenizer.from_file(tk_path)
    bos = tk.token_to_id("<s>")
    # Llama/Mistral prepend BOS to every prompt.
    tk.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                           special_tokens=[("<s>", bos)])
    tk.save(tk_path)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(chat_template=CHAT_TEMPLATE, add_bos_token=True, add_eos_token=False)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return tk.get_vocab_size(with_added_tokens=True)


def make_model(out_dir: str, spec: ModelSpec, init_device: str | None = None) -> str:
    """Write config.json, model.safetensors and tokenizer files to ``out_dir``.

    ``init_device`` (e.g. ``cuda``): fill the weights on that device instead of through HF's
    init on the CPU, for shapes of billions of parameters (the GPU benchmarks' Llama-3-8B
    shape: seconds instead of minutes). The values differ from HF's init (every matrix normal
    with std ``initializer_range``, norms one) but the names, shapes and dtype are the same."""
    spec.validate()
    import torch
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = write_tokenizer(out_dir)
    if spec.vocab_size < tok_vocab:
        raise ValueError(f"vocab_size={spec.vocab_size} is smaller than the tokenizer's {tok_vocab}")
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, initializer_range=spec.initializer_range,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )
    rope = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type == "llama3":
        rope.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=max(spec.max_position_embeddings // 4, 64))
    if spec.rope_type == "yarn":
        # DeepSeek-V3's kind of yarn; mscale != mscale_all_dim so cos/sin are scaled too.
        rope.update(factor=4.0, original_max_position_embeddings=max(spec.max_position_embeddings // 4, 64),
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
    config = _hf_config(spec, common, rope)
    model_cls = transformers.AutoModelForCausalLM
    if init_device is not None:
        _fill_on_device(out_dir, spec, config, init_device)
        return out_dir
    torch.manual_seed(spec.seed)
    model = model_cls.from_config(config, dtype=torch.float32)
    if spec.arch == "deepseek_v3":
        _randomize_correction_bias(model, spec.seed)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _fill_on_device(out_dir: str, spec: ModelSpec, config, device: str, shard_bytes: int = 4 << 30) -> None:
    """make_model's fast path: the names and shapes of HF's model (built on the meta device),
    each tensor drawn on ``device``, written in safetensors shards of up to ``shard_bytes``."""
    import torch
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    config.architectures = [type(model).__name__]
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    shards: list[dict] = [{}]
    size = 0
    for name, shape in shapes.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=gen, device=device) * 0.05
        else:
            t = (torch.randn(shape, generator=gen, device=device) * spec.initializer_range).to(dtype)
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, tensors in zip(names, shards):
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
    if len(shards) > 1:  # HF's index of a sharded checkpoint
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {n: file for file, s in zip(names, shards) for n in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    config.dtype = spec.dtype
    config.save_pretrained(out_dir)


def _hf_config(spec: ModelSpec, common: dict, rope: dict):
    """The transformers config of ``spec``'s family."""
    import transformers

    if spec.arch == "llama":
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if spec.arch == "mistral":
        return transformers.MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    if spec.arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if spec.arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=spec.head_size, rope_parameters=rope,
                                        use_sliding_window=False)
    if spec.arch == "deepseek_v3":
        return _deepseek_config(spec, common, rope)
    experts = dict(num_experts_per_tok=spec.num_experts_per_tok, head_dim=spec.head_size, rope_parameters=rope)
    if spec.arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, **experts, num_experts=spec.num_experts, moe_intermediate_size=spec.moe_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob, mlp_only_layers=list(spec.mlp_only_layers), use_sliding_window=False)
    return transformers.MixtralConfig(**common, **experts, num_local_experts=spec.num_experts, sliding_window=None)


def _deepseek_config(spec: ModelSpec, common: dict, rope: dict):
    import transformers

    common = dict(common, num_key_value_heads=spec.num_heads)  # MLA has no KV heads; HF's default
    return transformers.DeepseekV3Config(
        **common, rope_parameters=rope, moe_intermediate_size=spec.moe_intermediate_size,
        n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts, n_group=spec.n_group, topk_group=spec.topk_group,
        norm_topk_prob=spec.norm_topk_prob, routed_scaling_factor=spec.routed_scaling_factor,
        first_k_dense_replace=spec.first_k_dense_replace, q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_interleave=spec.rope_interleave,
        num_mtp_layers=0,
        # as DeepSeek-V3's own config.json says (vLLM keys its correction bias on topk_method)
        topk_method="noaux_tc", scoring_func="sigmoid")


def _randomize_correction_bias(model, seed: int) -> None:
    """HF initialises ``e_score_correction_bias`` to zeros; a random one makes the bias, used only to
    choose experts, change the choice in a made model (as a trained model's does)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            with torch.no_grad():
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)


def cached_model(make: dict, cache_dir: str | os.PathLike) -> str:
    """The directory of the model `make` describes (ModelSpec arguments) under `cache_dir`,
    made on first use: `pdserve-<arch>-<hash of the arguments>`, so the same arguments give
    the same directory (`pdserve up`, `pdserve worker` and the benchmarks share it)."""
    import hashlib
    from pathlib import Path

    spec = ModelSpec(**make)
    tag = hashlib.sha256(json.dumps(spec.tag_fields(), sort_keys=True).encode()).hexdigest()[:8]
    path = Path(cache_dir) / f"pdserve-{spec.arch}-{tag}"
    if not (path / "config.json").is_file():
        print(f"model     making a {spec.arch} model ({spec.num_layers} layers, hidden {spec.hidden_size}) "
              f"in {path} ...", flush=True)
        # Made beside it and renamed into place: a make that is interrupted (Ctrl-C, a killed
        # process) leaves no half-written directory that a later start would take for a model.
        part = path.with_name(f"{path.name}.part-{os.getpid()}")
        shutil.rmtree(part, ignore_errors=True)
        try:
            make_model(str(part), spec)
            if path.exists() and not (path / "config.json").is_file():
                shutil.rmtree(path)  # (an earlier version's half-written make)
            try:
                os.rename(part, path)
            except OSError:
                if not (path / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(part, ignore_errors=True)  # (another process made it first: theirs stands)
    return str(path)


def resolve_model(topology) -> str:
    """A loaded topology's model directory (anything with `model.is_auto`, `model.make`,
    `model_path` and `model_cache_path`, as `cluster.topology.Topology` has: the engine does
    not import the control plane); `auto` makes a small model on first use."""
    if not topology.model.is_auto:
        return str(topology.model_path)
    return cached_model(topology.model.make, topology.model_cache_path)

