"""The KV pool layout that two workers must share to exchange pages.

The engine allocates one pool per process (docs/architecture.md, "KV pool"):

    kv = torch.empty(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim, dtype)   # NHD
    kv = torch.empty(num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim, dtype)   # HND

so block `b` of layer `l` (its K and V pages together) starts at byte
`(l * num_blocks + b) * block_bytes` of the pool either way. A tensor-parallel rank's pool
holds only its KV heads (`num_kv_heads` here; the model's are `total_kv_heads`), so two
pools of different TP sizes exchange pages head range by head range, which is contiguous
inside a block only in HND (descriptors.py `plan_head_write`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.kvtransfer.nixl.errors import LayoutMismatchError

# Bytes per element of the dtypes a KV pool may hold (names as torch spells them).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

# Fields that must agree for two pools to exchange pages; num_blocks may differ, and so may
# num_kv_heads (a rank's share) between pools of different TP sizes: the model's KV heads
# (total_kv_heads) must agree, checked under the name num_kv_heads.
COMPATIBILITY_FIELDS = (
    "model_id",
    "kv_cache_dtype",
    "dtype",
    "kv_scales",
    "num_layers",
    "block_size",
    "head_dim",
    "kv_layout",
)
KV_LAYOUTS = ("NHD", "HND")

_INT_FIELDS = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")
_OPTIONAL_FIELDS = ("kv_layout", "total_kv_heads", "tp_size", "tp_rank", "kv_cache_dtype", "kv_scales")


def _scale(value: Any) -> float | tuple[float, ...]:
    """A K or V scale of a layout record: a number, or a tuple of per-head numbers."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("an empty list of per-head scales")
        return tuple(float(x) for x in value)
    return float(value)


@dataclass(frozen=True)
class KVLayout:
    """Shape, dtype and model of one worker's paged KV pool."""

    model_id: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str = "NHD"
    total_kv_heads: int = 0  # the model's KV heads; 0: the same as num_kv_heads (TP=1)
    tp_size: int = 1
    tp_rank: int = 0
    # The engine's kv_cache_dtype (auto, fp8_e4m3, fp8_e5m2) and, for FP8, each layer's
    # (k_scale, v_scale), each one number (per tensor) or one per KV head of the model (per head):
    # pages are read with the scales they were written with, so both must agree.
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[tuple[Any, Any], ...] = ()

    def __post_init__(self) -> None:
        try:
            scales = tuple((_scale(k), _scale(v)) for k, v in self.kv_scales)
        except (TypeError, ValueError):
            raise ValueError("KVLayout.kv_scales must list [k_scale, v_scale] pairs (each a number, or a list "
                             f"of one per KV head), got {self.kv_scales!r}") from None
        object.__setattr__(self, "kv_scales", scales)
        if not isinstance(self.kv_cache_dtype, str) or not self.kv_cache_dtype:
            raise ValueError(f"KVLayout.kv_cache_dtype must be a non-empty string, got {self.kv_cache_dtype!r}")
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"KVLayout.kv_layout {self.kv_layout!r}; use one of {list(KV_LAYOUTS)}")
        for name in ("total_kv_heads", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank!r} is outside tp_size={self.tp_size}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"KVLayout.model_id must be a non-empty string, got {self.model_id!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_ITEMSIZE)}"
            )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V pages together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def pool_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        inner = ((self.block_size, self.num_kv_heads) if self.kv_layout == "NHD"
                 else (self.num_kv_heads, self.block_size))
        return (self.num_layers, self.num_blocks, 2, *inner, self.head_dim)

    @property
    def half_bytes(self) -> int:
        """Bytes of the K (or V) half of one block of one layer."""
        return self.block_bytes // 2

    @property
    def head_bytes(self) -> int:
        """HND: bytes of one head's pages in one half-block (block_size x head_dim)."""
        return self.block_size * self.head_dim * self.itemsize

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of block `block` of layer `layer` from the start of the pool."""
        return (layer * self.num_blocks + block) * self.block_bytes

    @classmethod
    def from_tensor(cls, kv: Any, model_id: str, kv_layout: str = "NHD", total_kv_heads: int = 0,
                    tp_size: int = 1, tp_rank: int = 0, kv_cache_dtype: str = "auto",
                    kv_scales: Any = ()) -> KVLayout:
        """Layout of a pool tensor `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`
        (NHD) or `[..., 2, num_kv_heads, block_size, head_dim]` (HND); ``kv_cache_dtype`` and
        ``kv_scales`` are the engine's (its `layout_info()`)."""
        shape = tuple(kv.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(
                "a KV pool tensor must be shaped [num_layers, num_blocks, 2, block_size, "
                f"num_kv_heads, head_dim] (or HND: num_kv_heads before block_size); got {list(shape)}"
            )
        num_layers, num_blocks, _, a, b, head_dim = shape
        block_size, num_kv_heads = (a, b) if kv_layout == "NHD" else (b, a)
        return cls(
            model_id=model_id,
            dtype=str(kv.dtype).removeprefix("torch."),
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kv_layout=kv_layout,
            total_kv_heads=total_kv_heads,
            tp_size=tp_size,
            tp_rank=tp_rank,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=kv_scales,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record; `block_bytes` is included for humans and checked on load."""
        return {**asdict(self), "block_bytes": self.block_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        if not isinstance(data, dict):
            raise ValueError(f"a KV layout record must be a dict, got {type(data).__name__}")
        fields = {"model_id", "dtype", *_INT_FIELDS}
        missing = sorted(fields - data.keys())
        if missing:
            raise ValueError(f"KV layout record lacks {missing}")
        unknown = sorted(data.keys() - fields - {"block_bytes", *_OPTIONAL_FIELDS})
        if unknown:
            raise ValueError(f"KV layout record has unknown keys {unknown}")
        layout = cls(**{k: data[k] for k in (*fields, *_OPTIONAL_FIELDS) if k in data})
        if "block_bytes" in data and data["block_bytes"] != layout.block_bytes:
            raise ValueError(
                f"KV layout record says block_bytes={data['block_bytes']!r} but its shape and "
                f"dtype give {layout.block_bytes}"
            )
        return layout

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatchError naming the first field that prevents a page exchange."""
        for name in COMPATIBILITY_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise LayoutMismatchError(name, mine, theirs)
        if self.total_kv_heads != other.total_kv_heads:
            raise LayoutMismatchError("num_kv_heads", self.total_kv_heads, other.total_kv_heads)
        if self.tp_size == other.tp_size and self.num_kv_heads != other.num_kv_heads:
            raise LayoutMismatchError("num_kv_heads", self.num_kv_heads, other.num_kv_heads)
