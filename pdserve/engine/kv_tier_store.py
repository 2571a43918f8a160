"""Where the second KV tier's slots live, and how a block's bytes move (engine/kv_tier.py).

Each slot is one full block of every layer (K and V) in the pool's own layout, so a copy
either way is one strided copy per block and no conversion. The store (`TierStore`): host
memory (pinned) on a GPU worker, a file on a CPU worker, whose pool is host memory already
(a memory tier there would be the pool's own memory under another name; raise
``kv_cache_memory_bytes`` instead). docs/kvindex.md has the measurements.

The copies: `host_copy` between host tensors (off torch's OpenMP team), `load_to_device`
from pinned slots into a GPU pool's blocks, and `TierMirror`, a tensor-parallel rank's
store, which repeats rank 0's copies over this rank's heads.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod

import numpy as np
import torch

from pdserve.common.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

from .config import ConfigError

STAGING_BYTES = 64 << 20  # a GPU load moves through a device buffer of at most this many bytes at a time

# numpy stand-ins for dtypes it lacks, by element size: a copy moves bytes.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for host tensors of one dtype and shape, through numpy: torch's
    `copy_` of more than 32k elements starts an OpenMP region, and on this (copy) thread that
    would make a second OpenMP team beside the engine's, which slows every engine step
    (common/compute_thread.py). numpy copies on the calling thread alone."""
    if dst.dtype not in (torch.float16, torch.float32, torch.float64):
        dst, src = dst.view(_SAME_SIZE_INT[dst.element_size()]), src.view(_SAME_SIZE_INT[src.element_size()])
    np.copyto(dst.numpy(), src.numpy())


class TierStore(ABC):
    """Slots of whole blocks: ``view()`` is a [slots, layers, K/V, ...] tensor on the host."""

    medium: str

    @abstractmethod
    def view(self) -> torch.Tensor: ...

    def close(self) -> None:
        return None


class MemoryTierStore(TierStore):
    """Host memory; pinned when the pool is on a GPU (copies then run as DMA)."""

    medium = MEDIUM_CPU

    def __init__(self, slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self._t = torch.empty((slots, *block_shape), dtype=dtype, pin_memory=pin)

    def view(self) -> torch.Tensor:
        return self._t


class FileTierStore(TierStore):
    """A file mapped into memory (shared mapping): the page cache holds what fits, the disk
    the rest. The file is unlinked as soon as it is mapped, so nothing is left behind when
    the process ends, however it ends."""

    medium = MEDIUM_STORAGE

    def __init__(self, slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, directory: str | None):
        directory = directory or tempfile.gettempdir()
        if not os.path.isdir(directory):
            raise ConfigError(f"kv_offload_path={directory!r} is not a directory")
        numel = slots
        for d in block_shape:
            numel *= d
        fd, path = tempfile.mkstemp(prefix="pdserve-kv-tier-", suffix=".bin", dir=directory)
        try:
            os.ftruncate(fd, numel * dtype.itemsize)
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"kv_offload_path={directory!r}: cannot map a {numel * dtype.itemsize} byte tier "
                              f"file there ({exc}); choose a directory with room or lower kv_offload_bytes") from exc
        finally:
            os.close(fd)
            os.unlink(path)
        self.path = path
        self._t = flat.view(slots, *block_shape)

    def view(self) -> torch.Tensor:
        return self._t


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of every layer (K and V) of ``pool`` ([layers, blocks, ...])."""
    numel = pool.shape[0]
    for d in pool.shape[2:]:
        numel *= d
    return numel * pool.element_size()


def resolve_backend(backend: str, pool: torch.Tensor) -> str:
    if backend == "auto":
        backend = "memory" if pool.is_cuda else "file"
    if backend == "memory" and not pool.is_cuda:
        raise ConfigError("kv_offload_backend='memory' on a CPU engine: its pool is host memory already, so "
                          "raise kv_cache_memory_bytes instead, or use kv_offload_backend='file'")
    return backend


def make_store(backend: str, slots: int, pool: torch.Tensor, path: str | None) -> TierStore:
    block_shape = (pool.shape[0], *pool.shape[2:])
    if backend == "memory":
        return MemoryTierStore(slots, block_shape, pool.dtype, pool.is_cuda)
    return FileTierStore(slots, block_shape, pool.dtype, path)


def load_to_device(pool: torch.Tensor, data: torch.Tensor, slots: list[int], block_ids: list[int],
                   block_size_bytes: int) -> None:
    """Slots ``slots`` of ``data`` (pinned host memory) into the pool's blocks ``block_ids``,
    on the current stream: each run of consecutive slots is one DMA into a device staging
    buffer (no copy on the host, no pageable bounce), then one scatter into the blocks per
    chunk of `STAGING_BYTES`."""
    per_chunk = max(1, STAGING_BYTES // block_size_bytes)
    for c in range(0, len(slots), per_chunk):
        chunk, ids_chunk = slots[c:c + per_chunk], block_ids[c:c + per_chunk]
        staging = torch.empty((len(chunk), *data.shape[1:]), dtype=data.dtype, device=pool.device)
        i = 0
        while i < len(chunk):
            j = i + 1
            while j < len(chunk) and chunk[j] == chunk[j - 1] + 1:
                j += 1
            staging[i:j].copy_(data[chunk[i]:chunk[i] + (j - i)], non_blocking=True)
            i = j
        ids = torch.tensor(ids_chunk, dtype=torch.long).to(pool.device, non_blocking=True)
        pool.index_copy_(1, ids, staging.transpose(0, 1))


class TierMirror:
    """A tensor-parallel rank's share of the tier (ranks 1..N-1, engine/tp_rank.py): the same
    slots as rank 0's `KVTier`, over this rank's heads of each block, and the copies rank 0
    made, repeated in its order (``apply``) before the step they came with. Rank 0 keeps the
    slot table; this keeps only the data. The store is made at the first copies (their slot
    count is rank 0's)."""

    def __init__(self, pool: torch.Tensor, backend: str, path: str | None):
        self.pool, self.backend, self.path = pool, resolve_backend(backend, pool), path
        self.store: TierStore | None = None
        self.copies = 0

    def apply(self, slots: int, ops: list, sync: bool = False) -> None:
        """Make rank 0's copies here; with ``sync`` (block ids are leaving the engine) on a GPU
        wait until they have landed, as rank 0 does (`KVTier.flush`)."""
        if self.store is None:
            self.store = make_store(self.backend, slots, self.pool, self.path)
        data = self.store.view()
        for op, block, slot in ops:
            if op == "store":
                src, dst = self.pool[:, block], data[slot]
            elif op == "load":
                src, dst = data[slot], self.pool[:, block]
            else:
                raise ValueError(f"unknown tier copy {op!r}")
            if self.pool.is_cuda:  # on this rank's stream, ahead of the step's forward
                dst.copy_(src, non_blocking=True)
            else:
                host_copy(dst, src)
            self.copies += 1
        if sync and self.pool.is_cuda:
            torch.cuda.current_stream(self.pool.device).synchronize()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
