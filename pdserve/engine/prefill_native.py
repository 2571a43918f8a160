"""Causal attention of a fresh prompt through the native kernel (csrc/prefill_attn.c).

`TorchAttention` attends a prompt (or a chunk of one after cached or earlier-computed tokens,
their K/V gathered from the pool) through this when the kernel library loaded with its vector
path (AVX-512, head_dim a multiple of 16) and the chunk has more than ``PREFILL_MIN_QUERY``
tokens; the paged kernel or SDPA otherwise. ``PDSERVE_PREFILL_KERNEL=sdpa``
keeps SDPA for every prompt (the benchmark's ablation, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
import os

import torch

from .native import load_library

KEYS = 32  # the kernel's key step: K^T is padded to a multiple of it
ENV = "PDSERVE_PREFILL_KERNEL"


def _declare(lib) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_prefill_attn_ok.argtypes = [i64]
    lib.pdserve_prefill_attn_ok.restype = ctypes.c_int
    fn = lib.pdserve_prefill_attn_f32
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, i64]
    fn.restype = ctypes.c_int


def load(head_dim: int):
    """The kernel library when its vector path serves ``head_dim`` here; None otherwise (and
    with ``PDSERVE_PREFILL_KERNEL=sdpa``)."""
    if os.environ.get(ENV, "auto") == "sdpa":
        return None
    lib = load_library("prefill_attn.c", _declare)
    return lib if lib is not None and lib.pdserve_prefill_attn_ok(head_dim) else None


def prefill_attention(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      scale: float, q_offset: int = 0) -> None:
    """``out`` [T, Hq, D] = causal attention of ``q`` [T, Hq, D] over ``k``, ``v`` [q_offset + T,
    Hkv, D]: query row t is token ``q_offset + t`` (a chunk after ``q_offset`` earlier tokens;
    0 for a fresh prompt) and attends keys 0 .. q_offset + t. Float32; views into qkv (or a
    gathered copy of the pool) are read in place, other layouts copied; ``out`` is written in
    place and must have unit stride inside a head, heads adjacent."""
    T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"prefill attention: {name} must be float32 on the CPU")
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (q, k, v))
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"prefill attention: out has an unexpected layout {tuple(out.stride())}")
    keys = q_offset + T
    if out.shape != q.shape or k.shape != v.shape or k.shape[0] != keys or q_offset < 0 or num_heads % num_kv_heads:
        raise ValueError("prefill attention: q, k, v and out disagree on their shapes")
    t_pad = -(-keys // KEYS) * KEYS
    kt = torch.empty(num_kv_heads, head_dim, t_pad, dtype=torch.float32)
    kt[:, :, :keys] = k.permute(1, 2, 0)
    kt[:, :, keys:] = 0.0  # never a key (the causal mask ends every row first), but not garbage either
    rc = lib.pdserve_prefill_attn_f32(q.data_ptr(), q.stride(0), kt.data_ptr(), v.data_ptr(), v.stride(0),
                                      out.data_ptr(), out.stride(0), T, num_heads, num_kv_heads, head_dim, t_pad,
                                      scale, torch.get_num_threads(), q_offset)
    if rc != 0:
        raise RuntimeError("prefill attention: the kernel's vector path does not serve these shapes")
