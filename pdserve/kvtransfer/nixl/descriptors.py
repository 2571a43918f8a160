"""Turn a block-id mapping into byte ranges of two KV pools (pure, no I/O).

One descriptor covers one layer of one *run*: a stretch where both the local
and the remote block ids go up by one. A request whose pages sit in
consecutive blocks on both sides therefore costs one descriptor per layer,
however many blocks it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.kvtransfer.nixl.errors import LayoutMismatchError
from pdserve.kvtransfer.nixl.layout import KVLayout


@dataclass(frozen=True)
class WritePlan:
    """Byte ranges to copy, one row per descriptor, layer-major.

    Offsets are from the start of each pool; the agent adds the base addresses.
    """

    local_offsets: np.ndarray  # int64 [n]
    remote_offsets: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n], bytes
    layers: tuple[int, ...]

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())

    def local_rows(self, base_addr: int, device_id: int) -> np.ndarray:
        """NIXL's Nx3 descriptor array (address, length, device id) for the local pool."""
        return _rows(base_addr, self.local_offsets, self.lengths, device_id)

    def remote_rows(self, base_addr: int, device_id: int) -> np.ndarray:
        return _rows(base_addr, self.remote_offsets, self.lengths, device_id)

    def for_layer(self, layer: int) -> WritePlan:
        """The rows of one planned layer (every layer has the same runs)."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not in this plan's layers {list(self.layers)}")
        per_layer = self.num_descriptors // len(self.layers)
        start = self.layers.index(layer) * per_layer
        rows = slice(start, start + per_layer)
        return WritePlan(
            local_offsets=self.local_offsets[rows],
            remote_offsets=self.remote_offsets[rows],
            lengths=self.lengths[rows],
            layers=(layer,),
        )


def block_runs(
    local_ids: np.ndarray, remote_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a mapping into runs consecutive on both sides.

    Returns (local_starts, remote_starts, run_lengths_in_blocks).
    """
    n = local_ids.shape[0]
    breaks = np.flatnonzero((np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [n])))
    return local_ids[starts], remote_ids[starts], lengths


def plan_block_write(
    local: KVLayout,
    remote: KVLayout,
    local_block_ids: Sequence[int] | np.ndarray,
    remote_block_ids: Sequence[int] | np.ndarray,
    layers: Iterable[int] | None = None,
    coalesce: bool = True,
) -> WritePlan:
    """Plan the write of the K and V pages of `local_block_ids` into `remote_block_ids`.

    `local_block_ids[i]` is copied into `remote_block_ids[i]` for every layer in
    `layers` (all layers when None). `coalesce=False` keeps one descriptor per
    block and layer (for benchmarks). Raises ValueError on a malformed mapping.
    """
    local.check_compatible(remote)
    if local.num_kv_heads != remote.num_kv_heads:
        # Pools of different TP sizes are compatible (check_compatible), but their blocks are
        # not the same bytes: whole blocks would land at the wrong offsets. Head ranges do it.
        raise LayoutMismatchError("num_kv_heads", local.num_kv_heads, f"{remote.num_kv_heads} (tp_size "
                                  f"{remote.tp_size} against {local.tp_size}: move head ranges, plan_head_write)")
    src = _block_ids("local_block_ids", local_block_ids, local.num_blocks)
    dst = _block_ids("remote_block_ids", remote_block_ids, remote.num_blocks)
    if src.shape != dst.shape:
        raise ValueError(
            f"local_block_ids has {src.shape[0]} ids but remote_block_ids has {dst.shape[0]}; "
            "pass one remote block per local block"
        )
    if np.unique(dst).shape[0] != dst.shape[0]:
        raise ValueError(
            "remote_block_ids repeats a block; two pages written into one block would race"
        )
    layer_ids = _layer_ids(layers, local.num_layers)

    if coalesce:
        src_starts, dst_starts, run_blocks = block_runs(src, dst)
    else:
        src_starts, dst_starts, run_blocks = src, dst, np.ones_like(src)

    block_bytes = local.block_bytes
    layer_col = np.asarray(layer_ids, dtype=np.int64)[:, None]
    local_offsets = (layer_col * local.num_blocks + src_starts[None, :]) * block_bytes
    remote_offsets = (layer_col * remote.num_blocks + dst_starts[None, :]) * block_bytes
    lengths = np.broadcast_to(run_blocks[None, :] * block_bytes, local_offsets.shape)
    return WritePlan(
        local_offsets=local_offsets.reshape(-1),
        remote_offsets=remote_offsets.reshape(-1),
        lengths=np.ascontiguousarray(lengths).reshape(-1),
        layers=layer_ids,
    )


def plan_head_write(
    local: KVLayout,
    remote: KVLayout,
    src_head: int,
    dst_head: int,
    num_heads: int,
    local_block_ids: Sequence[int] | np.ndarray,
    remote_block_ids: Sequence[int] | np.ndarray,
    layers: Iterable[int] | None = None,
) -> WritePlan:
    """Plan the write of heads ``[src_head, src_head + num_heads)`` of our pool's blocks into heads
    ``[dst_head, ...)`` of the peer's (one `handoff.head_plan.HeadWrite`), for every layer.

    When the range is every head of both pools this is `plan_block_write` (whole blocks,
    runs coalesced). Otherwise both pools must be HND, where a head's pages in a half-block
    are one contiguous run: two descriptors (K, V) per block and layer, never one per token.
    """
    local.check_compatible(remote)
    for what, first, pool in (("src_head", src_head, local), ("dst_head", dst_head, remote)):
        if num_heads < 1 or first < 0 or first + num_heads > pool.num_kv_heads:
            raise ValueError(f"{what}={first} with num_heads={num_heads} is outside the pool's "
                             f"{pool.num_kv_heads} KV heads")
    if num_heads == local.num_kv_heads == remote.num_kv_heads:
        return plan_block_write(local, remote, local_block_ids, remote_block_ids, layers)
    if local.kv_layout != "HND":
        raise LayoutMismatchError("kv_layout", local.kv_layout, "HND (a handoff between different TP sizes "
                                  "writes head ranges, contiguous only in HND: set kv_layout: HND on both roles)")
    src = _block_ids("local_block_ids", local_block_ids, local.num_blocks)
    dst = _block_ids("remote_block_ids", remote_block_ids, remote.num_blocks)
    if src.shape != dst.shape:
        raise ValueError(f"local_block_ids has {src.shape[0]} ids but remote_block_ids has {dst.shape[0]}")
    if np.unique(dst).shape[0] != dst.shape[0]:
        raise ValueError("remote_block_ids repeats a block; two pages written into one block would race")
    layer_ids = _layer_ids(layers, local.num_layers)
    head_bytes = local.head_bytes
    layer_col = np.asarray(layer_ids, dtype=np.int64)[:, None, None]
    half: np.ndarray = np.arange(2, dtype=np.int64)[None, None, :]  # K, V
    local_offsets = ((layer_col * local.num_blocks + src[None, :, None]) * local.block_bytes
                     + half * local.half_bytes + src_head * head_bytes)
    remote_offsets = ((layer_col * remote.num_blocks + dst[None, :, None]) * remote.block_bytes
                      + half * remote.half_bytes + dst_head * head_bytes)
    return WritePlan(
        local_offsets=local_offsets.reshape(-1),
        remote_offsets=remote_offsets.reshape(-1),
        lengths=np.full(local_offsets.size, num_heads * head_bytes, dtype=np.int64),
        layers=layer_ids,
    )


def _block_ids(name: str, ids: Sequence[int] | np.ndarray, num_blocks: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of block ids")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = arr[(arr < 0) | (arr >= num_blocks)]
    if bad.shape[0]:
        raise ValueError(
            f"{name} has ids outside the pool's [0, {num_blocks}): {bad[:8].tolist()}"
        )
    return arr


def _layer_ids(layers: Iterable[int] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    layer_ids = tuple(int(layer) for layer in layers)
    if not layer_ids:
        raise ValueError("layers is empty; pass None for all layers")
    bad = [layer for layer in layer_ids if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"layers {bad} are outside [0, {num_layers})")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layers repeats a layer: {list(layer_ids)}")
    return layer_ids


def _rows(base_addr: int, offsets: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    rows = np.empty((offsets.shape[0], 3), dtype=np.uint64)
    rows[:, 0] = base_addr + offsets
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    return rows
