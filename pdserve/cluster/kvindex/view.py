"""What one worker's KV events add up to: the blocks it holds now, per tier.

Pure: fed batches in sequence order by a subscriber (cluster/kvindex/subscriber.py), or a snapshot
(which starts with AllBlocksCleared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

# Fastest first: a block held in several tiers counts as held in the fastest.
TIER_ORDER = {MEDIUM_GPU: 0, MEDIUM_CPU: 1, MEDIUM_STORAGE: 2}


def _fastest(media: set) -> str | None:
    return min(media, key=lambda m: TIER_ORDER.get(m, 3) if m is not None else 4)


@dataclass
class WorkerKVView:
    # hash -> (parent hash, the fastest medium holding it) of every block the worker holds now
    blocks: dict[bytes, tuple[bytes | None, str | None]] = field(default_factory=dict)
    # hash -> every medium holding it (a block copied to the second tier ahead of its eviction
    # is in both for a while: engine/kv_tier.py)
    media: dict[bytes, set] = field(default_factory=dict)
    applied_batches: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    held = self.media.setdefault(h, set())
                    held.add(e.medium)
                    self.blocks[h] = (parent, _fastest(held))
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    holding = self.media.get(h)
                    if holding is None:
                        continue
                    holding.discard(e.medium)
                    if e.medium is None or not holding:  # a remove without a medium: from every tier
                        del self.media[h]
                        self.blocks.pop(h, None)
                    else:
                        self.blocks[h] = (self.blocks[h][0], _fastest(holding))
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
                self.media.clear()
        self.applied_batches += 1

    def hashes(self) -> set[bytes]:
        return set(self.blocks)

    def longest_prefix(self, chain: list[bytes]) -> int:
        """How many leading blocks of ``chain`` (a prompt's block hashes) this worker holds."""
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            n += 1
        return n
