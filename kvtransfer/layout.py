"""The KV pool layout that two workers must share to exchange pages.

The engine allocates one pool per process (docs/architecture.md, "KV pool"):

    kv = torch.empty(num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim, dtype)

so block `b` of layer `l` (its K and V pages together) starts at byte
`(l * num_blocks + b) * block_bytes` of the pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.kvtransfer.errors import LayoutMismatchError

# Bytes per element of the dtypes a KV pool may hold (names as torch spells them).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

# Fields that must agree for two pools to exchange pages; num_blocks may differ.
COMPATIBILITY_FIELDS = (
    "model_id",
    "dtype",
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
)

_INT_FIELDS = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")


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

    def __post_init__(self) -> None:
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
        return (
            self.num_layers,
            self.num_blocks,
            2,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def block_offset(self, layer: int, block: int) -> int:
        """Byte offset of block `block` of layer `layer` from the start of the pool."""
        return (layer * self.num_blocks + block) * self.block_bytes

    @classmethod
    def from_tensor(cls, kv: Any, model_id: str) -> KVLayout:
        """Layout of a pool tensor `[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`."""
        shape = tuple(kv.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(
                "a KV pool tensor must be shaped [num_layers, num_blocks, 2, block_size, "
                f"num_kv_heads, head_dim]; got {list(shape)}"
            )
        num_layers, num_blocks, _, block_size, num_kv_heads, head_dim = shape
        return cls(
            model_id=model_id,
            dtype=str(kv.dtype).removeprefix("torch."),
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
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
        unknown = sorted(data.keys() - fields - {"block_bytes"})
        if unknown:
            raise ValueError(f"KV layout record has unknown keys {unknown}")
        layout = cls(**{k: data[k] for k in fields})
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
