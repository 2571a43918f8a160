"""What the scheduler, the block pool and the simulator share with a second KV tier
(engine/kv_tier.py): a load of prefix blocks (`TierLoad`), the tier's counters
(`TierStats`), and the calls they make on it (`SecondTier`: `KVTier`, or the simulator's
`SimTier`, sim/engine.py); and the copies rank 0's tier hands the other tensor-parallel
ranks (`MirrorOp`, `Mirror`: engine/llm_engine.py, `TierMirror` in engine/tp_rank.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from .block_manager import Block

# A copy the other tensor-parallel ranks repeat: ("store" | "load", block id, slot).
MirrorOp = tuple[str, int, int]
# Where rank 0's tier hands them (engine/llm_engine.py): (slots, ops, now).
Mirror = Callable[[int, "list[MirrorOp]", bool], None]


@dataclass(eq=False)
class TierLoad:
    """One request's prefix blocks coming back from the tier into pool blocks."""

    request_id: str
    hashes: list[bytes]
    parents: list[bytes | None]
    tokens: list[tuple[int, ...]]
    blocks: list["Block"]  # the pool blocks written (held until the load is finished)
    held: list["Block"]  # everything the load holds: the request's pool hits, then `blocks`
    slots: list[int] = field(default_factory=list)
    after: "torch.cuda.Event | None" = None  # GPU: an event on the engine's stream the load's copy waits for
    error: str | None = None
    seconds: float = 0.0
    finished: bool = False  # copied (or failed); the scheduler registers its blocks at its next look


@dataclass
class TierStats:
    offered: int = 0  # blocks offered for a copy ahead of eviction
    stored: int = 0  # copies committed
    dropped: int = 0  # copies dropped: the block was taken for other KV before the copy finished
    evicted: int = 0  # slots given to newer blocks
    loads: int = 0
    loaded_blocks: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    skipped_by_cost: int = 0  # tier hits computed anyway: loading was predicted slower
    sync_copies: int = 0  # copies made at eviction, on the engine thread (the copy thread had not reached them)


class SecondTier(Protocol):
    """What the scheduler and the block pool call on a second KV tier: `KVTier`, or the
    simulator's `SimTier` (sim/engine.py). A type for the checker only."""

    def flush(self, now: bool = True) -> None: ...

    def evicting(self, block: Block) -> None: ...

    def leading(self, hashes: list[bytes]) -> int: ...

    def worth_loading(self, blocks: int, compute_s_per_token: float | None, block_size: int) -> bool: ...

    def start_load(self, request_id: str, hashes: list[bytes], blocks: list[Block],
                   held: list[Block]) -> TierLoad | None: ...

    def finished_loads(self) -> list[TierLoad]: ...
