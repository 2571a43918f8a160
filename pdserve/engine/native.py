"""Native CPU kernels: built on first use with the machine's C compiler, cached, loaded with ctypes.

Declared here: paged decode attention in float32 over a float32 or float8 pool (csrc/paged_decode.c), which reads each
sequence's K and V rows in place in the KV pool instead of gathering them into a dense copy
for SDPA, which was a third of a batch-64 decode step's time (docs/PERFORMANCE.md). The other
libraries are built by the same `load_library` from their own modules: the tiled causal
kernel for long prompts (prefill_native.py), the LoRA kernel (lora_native.py).

- **Build**: `cc -O3 -march=native -fopenmp -shared` (compiler from `$CC`, else `cc`/`gcc`),
  about a second. The library lands in ``$PDSERVE_KERNEL_CACHE`` (default
  ``$XDG_CACHE_HOME/pdserve/kernels``, i.e. ``~/.cache/pdserve/kernels``) under a name that
  hashes the source (and the headers of csrc/), the compiler's version and the CPU's feature flags, so a cache shared
  between machines never hands one a library built for another's instructions. Written to
  a temporary file and renamed: concurrent workers building at once are safe.
- **Threads**: linked against `libgomp.so.1`, which resolves to the OpenMP runtime torch
  already loaded, so the kernel and torch's ops share one thread pool.
- **No compiler, a failed build, or not x86/arm64 Linux**: `load()` returns None with the
  reason in `why_unavailable()`; `attention_backend='auto'` then keeps the torch path and
  logs why once, `attention_backend='native'` is refused with that reason.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "paged_decode.c")
BUILD_TIMEOUT_S = 120.0
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> str:
    root = os.environ.get("PDSERVE_KERNEL_CACHE")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdserve", "kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str, source_path: str = SOURCE) -> str:
    with open(source_path, "rb") as f:
        source = f.read()
    for header in sorted(glob.glob(os.path.join(os.path.dirname(source_path), "*.h"))):
        with open(header, "rb") as f:  # (the headers a kernel includes: in the cache key too)
            source += f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()
                         + _cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
    out_dir = cache_dir()
    stem = os.path.splitext(os.path.basename(source_path))[0]
    path = os.path.join(out_dir, f"{stem}-{key}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, "-o", tmp, source_path], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the native CPU library %s", path)
    return path


def load_library(source_name: str, declare):
    """The library built from ``csrc/<source_name>`` (ctypes), building it on first use and
    calling ``declare(lib)`` to set its functions' signatures; None when it cannot be had
    (the reason: ``why_unavailable(source_name)``)."""
    with _lock:
        if source_name in _state:
            return _state[source_name][0]
        lib, why = None, None
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
            why = f"native kernels are built for Linux x86_64/aarch64, not {platform.system()} {platform.machine()}"
        elif (cc := _compiler()) is None:
            why = "no C compiler found ($CC, cc or gcc)"
        else:
            try:
                lib = ctypes.CDLL(_build(cc, os.path.join(CSRC, source_name)))
                declare(lib)
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                lib, why = None, f"building {source_name} failed: {exc}"
        _state[source_name] = (lib, why)
        return lib


def _declare_paged_decode(lib) -> None:
    fn = lib.pdserve_paged_decode_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int,
                   i64, i64]
    fn.restype = ctypes.c_int
    fp8 = lib.pdserve_paged_decode_fp8
    fp8.argtypes = [*fn.argtypes, ctypes.c_int, ptr, ptr]
    fp8.restype = ctypes.c_int


def load():
    """The kernel library (ctypes), building it on first use; None when it cannot be had."""
    return load_library("paged_decode.c", _declare_paged_decode)


def why_unavailable(source_name: str = "paged_decode.c") -> str | None:
    """Why that library could not be had (None when it loaded or was never asked for); asking
    about the kernels builds them first."""
    if source_name == "paged_decode.c":
        load()
    entry = _state.get(source_name)
    return entry[1] if entry else None


def check_rows(qidx: np.ndarray, lens: np.ndarray, tables: np.ndarray, num_rows: int, num_blocks: int,
               block_size: int) -> None:
    """Refuse inputs that would make the kernel read outside the pool or write outside
    ``out`` (once per step: every layer reuses the same arrays)."""
    if qidx.dtype != np.int64 or lens.dtype != np.int32 or tables.dtype != np.int32 or not tables.flags.c_contiguous:
        raise TypeError("paged decode attention: qidx int64, lens int32, tables C-contiguous int32")
    if not len(qidx) == len(lens) == tables.shape[0]:
        raise ValueError("paged decode attention: qidx, lens and tables disagree on the number of rows")
    if len(lens) and (lens.min() < 1 or lens.max() > tables.shape[1] * block_size or tables.min() < 0
                      or tables.max() >= num_blocks or qidx.min() < 0 or qidx.max() >= num_rows):
        raise ValueError("paged decode attention: a sequence length, block id or query row is out of range")


# float8 pool dtypes -> the kernel's fmt, and the factor its scales carry (csrc/paged_decode.c:
# a float8 byte read as a half's bit pattern is its value times 2^-8 for e4m3, times 1 for e5m2).
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
FP8_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}


def paged_decode(lib, q: torch.Tensor, layer_kv: torch.Tensor, out: torch.Tensor, qidx: np.ndarray,
                 lens: np.ndarray, tables: np.ndarray, scale: float, checked: bool = False,
                 max_len: int = 0, fp8_scales: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Attention for the listed query rows (see csrc/paged_decode.c for the layouts).

    A float8 pool (``layer_kv`` float8_e4m3fn or float8_e5m2) is read with ``fp8_scales``: each
    local KV head's K and V scale times `FP8_FACTOR` of the format (`KVQuant.native_scales`).

    ``q`` [T, Hq, D] float32 with unit stride inside a token; ``layer_kv`` one layer's pool
    as [num_blocks, 2, block_size, Hkv, D]: contiguous (NHD storage) or the transposed view of
    a contiguous HND pool (``pool.transpose(2, 3)``); ``out`` [T, Hq, D] contiguous (rows ``qidx`` written); ``qidx`` int64,
    ``lens`` int32 and ``tables`` int32 [n, max_blocks] C-contiguous numpy arrays, checked by
    `check_rows` unless the caller did (``checked``, then ``max_len`` = ``lens.max()``).
    """
    num_blocks, _, block_size, num_kv_heads, head_dim = layer_kv.shape
    num_heads = q.shape[1]
    fmt = FP8_FORMATS.get(layer_kv.dtype, 0)
    if fmt and fp8_scales is None:
        raise TypeError("paged decode attention over a float8 pool needs its scales (fp8_scales)")
    if q.dtype != torch.float32 or (layer_kv.dtype != torch.float32 and not fmt) or out.dtype != torch.float32:
        raise TypeError("paged decode attention runs float32 (and float8 pools) only")
    pool_ok = layer_kv.is_contiguous() or layer_kv.transpose(2, 3).is_contiguous()
    if not (q.stride(2) == 1 and q.stride(1) == head_dim and pool_ok and out.is_contiguous()
            and out.shape == q.shape and num_heads % num_kv_heads == 0):
        raise ValueError("paged decode attention: q, the pool or out has an unexpected layout")
    if not checked:
        check_rows(qidx, lens, tables, q.shape[0], num_blocks, block_size)
    args = (q.data_ptr(), q.stride(0), layer_kv.data_ptr(), out.data_ptr(),
            qidx.ctypes.data, lens.ctypes.data, tables.ctypes.data, tables.shape[1], len(qidx),
            num_heads, num_kv_heads, head_dim, block_size, scale, max_len or int(lens.max(initial=1)),
            torch.get_num_threads(), layer_kv.stride(2), layer_kv.stride(3))
    if fmt:
        k_scales, v_scales = fp8_scales  # type: ignore[misc]
        if not (k_scales.shape == v_scales.shape == (num_kv_heads,) and k_scales.dtype == v_scales.dtype == np.float32
                and k_scales.flags.c_contiguous and v_scales.flags.c_contiguous):
            raise ValueError(f"paged decode attention: fp8_scales must be two float32 arrays of {num_kv_heads} values")
        rc = lib.pdserve_paged_decode_fp8(*args, fmt, k_scales.ctypes.data, v_scales.ctypes.data)
    else:
        rc = lib.pdserve_paged_decode_f32(*args)
    if rc != 0:
        raise MemoryError("paged decode attention: could not allocate its score buffers")
