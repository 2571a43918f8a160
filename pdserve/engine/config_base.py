"""What every engine configuration shares: `ConfigError` and the dtype names.

The model's dtype (`dtype`: float32, float16, bfloat16 and their aliases) and the KV cache's
(`kv_cache_dtype`, vLLM's names: ``auto`` stores K/V in the model's dtype, ``fp8`` /
``fp8_e4m3`` in float8 e4m3, ``fp8_e5m2`` in float8 e5m2; docs/kv_cache.md).
"""

from __future__ import annotations

import torch

from .config_error import ConfigError as ConfigError

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype, field_name: str = "dtype") -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(
            f"{field_name}={value!r} is not supported; use one of float32, float16, bfloat16"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

# kv_cache_dtype -> (its canonical name, the pool's storage dtype; None: the model's dtype).
KV_CACHE_DTYPES: dict[str, tuple[str, torch.dtype | None]] = {
    "auto": ("auto", None),
    "fp8": ("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e4m3": ("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": ("fp8_e5m2", torch.float8_e5m2),
}


def parse_kv_cache_dtype(value: str) -> tuple[str, torch.dtype | None]:
    """``kv_cache_dtype``'s canonical name and the pool's storage dtype (None: the model's)."""
    try:
        return KV_CACHE_DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(
            f"kv_cache_dtype={value!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None
