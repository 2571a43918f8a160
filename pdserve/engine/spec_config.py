"""The engine argument ``speculative_config``, read the vLLM way (docs/speculative.md).

``speculative_config`` is a dict, as vLLM's ``LLM(..., speculative_config={...})`` takes it:
``method`` (only ``"ngram"``: prompt lookup; draft models and EAGLE are refused for now),
``num_speculative_tokens`` (k, the tokens proposed per step), ``prompt_lookup_min`` /
``prompt_lookup_max`` (the n-gram lengths tried, longest first; one given alone sets both,
neither given: 5 and 5, as vLLM), and the load rule's knobs: ``disable_by_batch_size`` (vLLM's
name: no request speculates in a step whose running batch is larger; default 32),
``acceptance_floor`` (a request whose recent acceptance falls below it stops proposing for
``probe_interval`` steps, then tries again; default 0.2 and 8). Every error is a
`ConfigError` naming the field, ``speculative_config.<key>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .config import ConfigError

METHODS = ("ngram",)
LATER = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
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


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _int(raw: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = raw.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{_field(name)}={v!r} must be an int in [{lo}, {hi}]")
    return v


def parse_speculative_config(raw: dict | str | None) -> SpeculativeConfig | None:
    """The checked config (None: no speculation); `ConfigError` naming the field otherwise.
    A JSON string is taken too (``--speculative-config '{"method": "ngram", ...}'``)."""
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
    method = raw.get("method", "ngram")
    if method not in METHODS:
        later = " (not supported yet)" if method in LATER else ""
        raise ConfigError(f"{_field('method')}={method!r}{later}; use one of: {', '.join(METHODS)}")
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
    return SpeculativeConfig(method, k, lo, hi, batch, float(floor), probe)
