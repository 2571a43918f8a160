"""The cluster prefix index: which workers (and which of their tiers) hold a prompt's prefix.

One `WorkerKVView` per worker (kept exact by its `KVEventSubscriber`); the index answers
"how many leading blocks of this prompt does each worker hold, and in which tier", and
counts what it answered (hit rates per worker and tier, for the metrics). A worker that
leaves is dropped; one that comes back starts from a snapshot. Pure: the service
(cluster/kvindex/service.py) feeds it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.common.block_hash import block_hashes

from pdserve.cluster.kvindex.view import WorkerKVView


@dataclass(frozen=True)
class PrefixHit:
    worker_id: str
    blocks: int  # leading blocks of the prompt the worker holds
    tokens: int  # blocks * block_size
    media: tuple[str | None, ...]  # the tier of each of those blocks

    def by_medium(self) -> dict[str | None, int]:
        return dict(Counter(self.media))


@dataclass
class ClusterKVIndex:
    block_size: int
    views: dict[str, WorkerKVView] = field(default_factory=dict)
    # What queries found: per (worker, medium) the blocks hit; per worker the blocks asked.
    hit_blocks: Counter = field(default_factory=Counter)
    asked_blocks: Counter = field(default_factory=Counter)
    queries: int = 0

    def set_view(self, worker_id: str, view: WorkerKVView) -> None:
        self.views[worker_id] = view

    def drop(self, worker_id: str) -> None:
        self.views.pop(worker_id, None)

    def hashes(self) -> set[bytes]:
        """Every block some worker holds."""
        out: set[bytes] = set()
        for v in self.views.values():
            out |= v.hashes()
        return out

    def holders(self, block_hash: bytes) -> dict[str, str | None]:
        """The workers holding ``block_hash``, with the tier each holds it in."""
        return {w: v.blocks[block_hash][1] for w, v in self.views.items() if block_hash in v.blocks}

    def prompt_hashes(self, token_ids: list[int], salt: bytes | None = None) -> list[bytes]:
        """The block hashes of a prompt's full blocks (the engine's: common/block_hash.py)."""
        return block_hashes(list(token_ids), self.block_size, salt)

    def longest_prefixes(self, token_ids: list[int], salt: bytes | None = None, *,
                         count: bool = True) -> list[PrefixHit]:
        """Each worker's cached prefix of the prompt, longest first (ties: worker id)."""
        chain = self.prompt_hashes(token_ids, salt)
        hits = []
        for w, v in self.views.items():
            n = v.longest_prefix(chain)
            hits.append(PrefixHit(w, n, n * self.block_size, tuple(v.blocks[h][1] for h in chain[:n])))
            if count:
                self.asked_blocks[w] += len(chain)
                for medium, k in Counter(v.blocks[h][1] for h in chain[:n]).items():
                    self.hit_blocks[(w, medium)] += k
        if count:
            self.queries += 1
        return sorted(hits, key=lambda h: (-h.blocks, h.worker_id))
