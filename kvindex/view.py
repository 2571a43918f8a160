"""What one worker's KV events add up to: the blocks it holds now, per tier.

Pure: fed batches in sequence order by a subscriber (kvindex/subscriber.py), or a snapshot
(which starts with AllBlocksCleared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass
class WorkerKVView:
    # hash -> (parent hash, medium) of every block the worker holds now
    blocks: dict[bytes, tuple[bytes | None, str | None]] = field(default_factory=dict)
    applied_batches: int = 0

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    self.blocks[h] = (parent, e.medium)
                    parent = h
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self.blocks.pop(h, None)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
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
