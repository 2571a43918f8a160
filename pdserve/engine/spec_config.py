"""The engine argument ``speculative_config``, read the vLLM way (docs/speculative.md).

``speculative_config`` is a dict, as vLLM's ``LLM(..., speculative_config={...})`` takes it:
``method`` (``"ngram"``: prompt lookup; ``"draft_model"``: a small model proposes,
engine/spec_draft.py; ``"eagle"`` / ``"eagle3"``: an EAGLE head fed the target's hidden states,
engine/spec_eagle.py; ``"mtp"`` (vLLM's older ``"deepseek_mtp"`` too): a DeepSeek-V3 checkpoint's
multi-token-prediction layer, run as an EAGLE head, engine/spec_mtp_model.py; Medusa and the
others are refused for now; as in vLLM, a config with ``model`` and no ``method`` is a draft
model's, and one with neither is n-gram's), ``model`` (the draft model's directory: same
vocabulary as the target's; or the EAGLE head's; for MTP the checkpoint holding the layer,
the target's own directory when not given),
``draft_tensor_parallel_size``
(vLLM's; only 1: the draft runs whole on the target's first device), ``draft_kv_cache_fraction``
(pdserve's: the draft's KV pool has this fraction of the target pool's blocks; default 1.0),
``num_speculative_tokens`` (k, the tokens proposed per step), ``prompt_lookup_min`` /
``prompt_lookup_max`` (the n-gram lengths tried, longest first; one given alone sets both,
neither given: 5 and 5, as vLLM), and the load rule's knobs: ``disable_by_batch_size`` (vLLM's
name: no request speculates in a step whose running batch is larger; default 32),
``acceptance_floor`` (a request whose recent acceptance falls below it stops proposing for
``probe_interval`` steps, then tries again; default 0.2 and 8), ``disable_by_cost`` (pdserve's:
steps speculate only while measured speculating steps emit more tokens per unit of time than
plain ones, engine/spec_cost.py; default true for the methods whose proposer runs a model,
false for n-gram), ``draft_sampling`` (pdserve's, for the methods whose proposer runs a model:
``probabilistic``, the default, draws an unseeded sampling request's proposals from the
draft's distribution and verifies them against it, engine/spec_decode.py `verify_draft_probs`;
``greedy`` proposes the draft's argmax for every request), ``draft_prompt_kv`` (pdserve's, for
the methods whose proposer runs a model: ``prefill`` has a prefill worker with the same draft
or head compute its KV of a remote request's prompt beside the target's and ship it in the same
handoff; ``decode`` leaves it to the decode worker, the default; ``auto`` chooses per request,
engine/spec_ship.py `ship_prompt_kv`, and for a head always ships: the decode worker has no
hidden states of a remote prompt to compute the head's rows from, engine/spec_eagle.py). Every error is a
`ConfigError` naming the field, ``speculative_config.<key>``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .config import ConfigError, ModelConfig

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")  # the methods whose ``model`` is a directory
HEAD_METHODS = ("eagle", "eagle3", "mtp")  # the methods whose head reads the target's hidden states
LATER = ("medusa", "mlp_speculator", "suffix")
MAX_SPECULATIVE_TOKENS = 16  # far past where prompt lookup pays; bounds a step's rows per request
MAX_LOOKUP = 64  # the longest n-gram tried


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 32
    acceptance_floor: float = 0.2
    probe_interval: int = 8
    model: str | None = None  # the draft model's (or EAGLE head's) directory
    draft_tensor_parallel_size: int = 1
    draft_kv_cache_fraction: float = 1.0  # the draft pool's blocks: this fraction of the target's
    # the measured-cost rule (engine/spec_cost.py): on by default where proposing costs a forward
    # (draft_model, eagle, eagle3, mtp), off for n-gram
    disable_by_cost: bool = False
    # draft_model / eagle / eagle3 / mtp: how a sampling request's proposals are drawn (probabilistic:
    # from the draft's distribution, verified with it; greedy: the draft's argmax)
    draft_sampling: str = "greedy"
    # A draft or head across prefill/decode: "prefill", a prefill worker that has the same one
    # computes its KV of the prompt beside the target's and ships it in the same handoff (one
    # that has none leaves it to the decode worker); "decode", the decode worker always computes
    # it itself; "auto", per request: shipped when the decode worker has streams decoding that a
    # local computation would stall (engine/spec_ship.py `ship_prompt_kv`), always for a head
    draft_prompt_kv: str = "decode"


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _int(raw: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = raw.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{_field(name)}={v!r} must be an int in [{lo}, {hi}]")
    return v


def parse_speculative_config(raw: dict | str | None, check_files: bool = True) -> SpeculativeConfig | None:
    """The checked config (None: no speculation); `ConfigError` naming the field otherwise.
    A JSON string is taken too (``--speculative-config '{"method": "ngram", ...}'``).
    ``check_files=False``: the draft model's directory is not read (the topology's check, made
    where the workers' paths may not exist; each worker reads it when it starts)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"speculative_config: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"speculative_config must be a dict (or null), got {type(raw).__name__}")
    known = {f for f in SpeculativeConfig.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{_field(unknown[0])}: unknown key; valid: {', '.join(sorted(known))}")
    method = _method(raw)
    if "num_speculative_tokens" not in raw:
        raise ConfigError(f"{_field('num_speculative_tokens')} is required")
    k = _int(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, None)
    lo = _int(raw, "prompt_lookup_min", 1, MAX_LOOKUP, None)
    hi = _int(raw, "prompt_lookup_max", 1, MAX_LOOKUP, None)
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    assert lo is not None and hi is not None and k is not None
    if lo > hi:
        raise ConfigError(f"{_field('prompt_lookup_min')}={lo} must be <= {_field('prompt_lookup_max')}={hi}")
    batch = _int(raw, "disable_by_batch_size", 1, 1 << 20, 32)
    probe = _int(raw, "probe_interval", 1, 1 << 20, 8)
    floor = raw.get("acceptance_floor", 0.2)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
        raise ConfigError(f"{_field('acceptance_floor')}={floor!r} must be a number in [0, 1]")
    assert batch is not None and probe is not None
    by_cost = raw.get("disable_by_cost", method != "ngram")
    if not isinstance(by_cost, bool):
        raise ConfigError(f"{_field('disable_by_cost')}={by_cost!r} must be true or false")
    if method == "ngram":
        for name in ("model", "draft_tensor_parallel_size", "draft_kv_cache_fraction", "draft_sampling",
                     "draft_prompt_kv"):
            if name in raw and not (name == "model" and raw[name] in ("ngram", "[ngram]")):  # (vLLM's spelling)
                raise ConfigError(f"{_field(name)} is for methods {', '.join(MODEL_METHODS)}, not 'ngram'")
        return SpeculativeConfig(method, k, lo, hi, batch, float(floor), probe, disable_by_cost=by_cost)
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if name in raw:
            raise ConfigError(f"{_field(name)} is for method 'ngram', not {method!r}")
    if method == "mtp":
        model = _mtp_dir(raw, check_files)
    elif method in ("eagle", "eagle3"):
        model = _head_dir(raw, method)
        if check_files:
            from .spec_eagle_model import check_head_dir  # (torch loads only here)

            check_head_dir(model, method)
    else:
        model = _draft_model(raw, check_files)
    prompt_kv = raw.get("draft_prompt_kv", "decode")
    if prompt_kv not in DRAFT_PROMPT_KV:
        raise ConfigError(f"{_field('draft_prompt_kv')}={prompt_kv!r} must be one of: {', '.join(DRAFT_PROMPT_KV)}")
    return SpeculativeConfig(method, k, 5, 5, batch, float(floor), probe, model=model, draft_prompt_kv=prompt_kv,
                             draft_tensor_parallel_size=_draft_tp(raw), draft_kv_cache_fraction=_fraction(raw),
                             disable_by_cost=by_cost, draft_sampling=_draft_sampling(raw))


DRAFT_SAMPLING = ("probabilistic", "greedy")
DRAFT_PROMPT_KV = ("auto", "prefill", "decode")


def _draft_sampling(raw: dict) -> str:
    v = raw.get("draft_sampling", "probabilistic")
    if v not in DRAFT_SAMPLING:
        raise ConfigError(f"{_field('draft_sampling')}={v!r} must be one of: {', '.join(DRAFT_SAMPLING)}")
    return str(v)


def _method(raw: dict) -> str:
    """The method, inferred as vLLM does when absent: ``model`` given means a draft model (unless
    it names n-gram), no ``model`` means n-gram."""
    method = raw.get("method")
    if method is None:
        model = raw.get("model")
        method = "ngram" if model is None or model in ("ngram", "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method == "deepseek_mtp":  # (vLLM's older name)
        method = "mtp"
    if method not in METHODS:
        later = " (not supported yet)" if method in LATER else ""
        raise ConfigError(f"{_field('method')}={method!r}{later}; use one of: {', '.join(METHODS)}")
    return method


def _draft_model(raw: dict, check_files: bool = True) -> str:
    """The draft model's directory: it must hold a model this engine runs (its config.json read
    now; its vocabulary is compared with the target's when the engine is made, engine/spec_draft.py)."""
    path = raw.get("model")
    if path is None:
        raise ConfigError(f"{_field('model')} is required for method 'draft_model' (the draft model's directory)")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{_field('model')}={path!r} must be a model directory path")
    if not check_files:
        return path
    try:
        ModelConfig.from_dir(path)
    except ConfigError as exc:
        raise ConfigError(f"{_field('model')}={path!r} is not a model this engine runs: {exc}") from None
    return path


def _head_dir(raw: dict, method: str) -> str:
    """The EAGLE head's directory (read by engine/spec_eagle_model.py)."""
    path = raw.get("model")
    if path is None:
        raise ConfigError(f"{_field('model')} is required for method {method!r} (the EAGLE head's directory)")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{_field('model')}={path!r} must be an EAGLE head's directory path")
    return path


def _mtp_dir(raw: dict, check_files: bool) -> str | None:
    """The checkpoint with the MTP layer: None (the target's own directory, known when the engine
    is made) unless given; its layers are read by engine/spec_mtp_model.py."""
    path = raw.get("model")
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{_field('model')}={path!r} must be a directory path (the checkpoint with the MTP layer)")
    if check_files:
        from .spec_mtp_model import mtp_layers  # (torch loads only here)

        if not os.path.isdir(path):
            raise ConfigError(f"{_field('model')}={path!r}: no such directory (the checkpoint with the MTP layer)")
        if mtp_layers(path) < 1:
            raise ConfigError(f"{_field('model')}={path!r}: config.json has no num_nextn_predict_layers: the "
                              "checkpoint has no MTP layer")
    return path


def _draft_tp(raw: dict) -> int:
    tp = raw.get("draft_tensor_parallel_size", 1)
    if tp != 1 or isinstance(tp, bool):
        raise ConfigError(f"{_field('draft_tensor_parallel_size')}={tp!r}: only 1 is supported (the draft model "
                          "runs whole on the target's first device)")
    return 1


def _fraction(raw: dict) -> float:
    v = raw.get("draft_kv_cache_fraction", 1.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
        raise ConfigError(f"{_field('draft_kv_cache_fraction')}={v!r} must be a number in (0, 1]")
    return float(v)
