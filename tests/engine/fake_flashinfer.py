"""A CPU stand-in for the parts of FlashInfer the engine calls, written from FlashInfer's
documentation (0.7: `BatchPrefillWithPagedKVCacheWrapper`, `BatchDecodeWithPagedKVCacheWrapper`,
`append_paged_kv_cache`; NHD pages, K and V stacked on dim 1) in the plainest way: a loop over
sequences, pages gathered one by one. It checks what the documentation requires of the
caller (int32 plan inputs on the host, keyword arguments after ``page_size``, plan before
run, the page table already covering appended tokens) so that the engine's FlashInfer
backend can be tested for its inputs and results where no GPU exists. The kernels' own
numerics are for the `gpu` tests.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

calls: list[tuple[str, dict]] = []  # (what, facts) in call order, for the tests


def _host_i32(name: str, t: torch.Tensor) -> list[int]:
    assert t.device.type == "cpu", f"{name}: plan inputs belong on the host (got {t.device})"
    assert t.dtype == torch.int32, f"{name}: int32 expected, got {t.dtype}"
    assert t.dim() == 1, f"{name}: 1-D expected"
    return t.tolist()


def _dev_i32(name: str, t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), f"{name}: contiguous int32 vector"
    return t.tolist()


class _Paged:
    """Shared plan state: the CSR page table and the head geometry."""

    def _set(self, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, sm_scale, q_data_type, kv_data_type):
        self.kv_indptr = _host_i32("indptr", kv_indptr)
        self.kv_indices = _host_i32("indices", kv_indices)
        self.last = _host_i32("last_page_len", last_page_len)
        b = len(self.last)
        assert len(self.kv_indptr) == b + 1 and self.kv_indptr[-1] == len(self.kv_indices)
        assert all(1 <= n <= page_size for n in self.last), "1 <= last_page_len <= page_size"
        assert num_qo_heads % num_kv_heads == 0
        self.heads, self.kv_heads, self.head_dim, self.page_size = num_qo_heads, num_kv_heads, head_dim, page_size
        self.scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type
        self.planned = True

    def _kv_len(self, i: int) -> int:
        pages = self.kv_indptr[i + 1] - self.kv_indptr[i]
        return (pages - 1) * self.page_size + self.last[i]

    def _seq_kv(self, cache: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]]
        kv = torch.cat([cache[p] for p in pages], dim=1)  # [2, pages * page_size, H, D]
        n = self._kv_len(i)
        return kv[0, :n], kv[1, :n]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n, Hq, D] against k, v [kv_len, Hkv, D], causal aligned to the end of the KV."""
        n, kv_len = q.shape[0], k.shape[0]
        allowed = torch.arange(kv_len)[None, :] <= (kv_len - n + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=allowed[None, None], scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _check_run(self, q: torch.Tensor, cache: torch.Tensor) -> None:
        assert getattr(self, "planned", False), "run() before plan()"
        assert cache.dim() == 5 and cache.shape[1] == 2, "one NHD tensor [pages, 2, page_size, H, D]"
        assert cache.shape[2] == self.page_size and cache.shape[3] == self.kv_heads
        assert q.shape[1:] == (self.heads, self.head_dim) and q.is_contiguous()
        assert q.dtype == self.q_dtype and cache.dtype == self.kv_dtype


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"):
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
             q_data_type=torch.float16, kv_data_type=None, **unused):
        assert causal, "the engine's steps are causal"
        self.qo_indptr = _host_i32("qo_indptr", qo_indptr)
        self._set(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                  head_dim_qk, page_size, sm_scale, q_data_type, kv_data_type or q_data_type)
        calls.append(("plan_prefill", {"batch": len(self.last)}))

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        self._check_run(q, paged_kv_cache)
        out = torch.empty_like(q)
        for i in range(len(self.last)):
            q0, q1 = self.qo_indptr[i], self.qo_indptr[i + 1]
            assert q1 - q0 <= self._kv_len(i), "a sequence's KV includes its new tokens"
            out[q0:q1] = self._attend(q[q0:q1], *self._seq_kv(paged_kv_cache, i))
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.use_tensor_cores = use_tensor_cores
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert all(torch.is_tensor(b) for b in (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                                    paged_kv_last_page_len_buffer))
            self.fixed_batch = len(paged_kv_last_page_len_buffer)
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, q_data_type=torch.float16, kv_data_type=None, sm_scale=None, **unused):
        self._set(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                  sm_scale, q_data_type, kv_data_type or q_data_type)
        if self.use_cuda_graph:
            assert len(self.last) == self.fixed_batch, "a CUDA-graph wrapper keeps its batch size"
            ip, ix, lp = self.buffers
            assert len(self.kv_indices) <= len(ix), "more pages than the graph's indices buffer"
            ip.copy_(indptr)
            ix[:len(self.kv_indices)].copy_(indices)
            lp.copy_(last_page_len)
        calls.append(("plan_decode", {"batch": len(self.last), "tensor_cores": self.use_tensor_cores,
                                      "wrapper": id(self)}))

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        if self.use_cuda_graph:  # a replayed graph reads the static buffers, not what plan() saw
            ip, ix, lp = self.buffers
            self.kv_indptr, self.last = ip.tolist(), lp.tolist()
            self.kv_indices = ix[:self.kv_indptr[-1]].tolist()
        self._check_run(q, paged_kv_cache)
        calls.append(("run_decode", {"wrapper": id(self)}))
        assert q.shape[0] == len(self.last), "decode: one query token per sequence"
        out = torch.empty_like(q)
        for i in range(len(self.last)):
            out[i:i + 1] = self._attend(q[i:i + 1], *self._seq_kv(paged_kv_cache, i))
        return out


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD") -> None:
    assert kv_layout == "NHD" and paged_kv_cache.dim() == 5
    assert append_key.stride(-1) == 1 and append_value.stride(-1) == 1, "last dim contiguous"
    batch = _dev_i32("batch_indices", batch_indices)
    pos = _dev_i32("positions", positions)
    indices, indptr, last = (_dev_i32(n, t) for n, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                                                          ("kv_last_page_len", kv_last_page_len)))
    page_size = paged_kv_cache.shape[2]
    assert len(batch) == len(pos) == append_key.shape[0] == append_value.shape[0]
    for t, (b, p) in enumerate(zip(batch, pos)):
        kv_len = (indptr[b + 1] - indptr[b] - 1) * page_size + last[b]
        assert p < kv_len, "the page table must already cover the appended tokens"
        page = indices[indptr[b] + p // page_size]
        paged_kv_cache[page, 0, p % page_size] = append_key[t]
        paged_kv_cache[page, 1, p % page_size] = append_value[t]
    calls.append(("append", {"tokens": len(batch)}))


def module() -> types.ModuleType:
    """This file as the `flashinfer` module the engine imports."""
    mod = types.ModuleType("flashinfer")
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper",
                 "append_paged_kv_cache"):
        setattr(mod, name, globals()[name])
    return mod
