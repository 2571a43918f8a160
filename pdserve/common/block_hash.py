"""The content hash of a KV block: one definition for the engine's prefix cache, its KV
events (common/kv_events.py) and the cluster's KV index (cluster/kvindex/), which hashes a prompt
to ask who holds its prefix.

Hashes chain over full blocks: ``hash(parent_hash, token_ids, salt)`` (sha256, 32 bytes),
so a block's hash names its whole prefix, and a hit on block i implies hits on 0..i-1.
"""

from __future__ import annotations

import hashlib
import struct


def hash_block(parent: bytes | None, token_ids, salt: bytes | None = None) -> bytes:
    """Content hash of one full block, chained on its parent's hash."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if salt:
        h.update(salt)
    return h.digest()


def block_hashes(token_ids: list[int], block_size: int, salt: bytes | None = None,
                 start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of ``token_ids``, extending ``start`` if given."""
    out = list(start or [])
    for i in range(len(out), len(token_ids) // block_size):
        parent = out[-1] if out else None
        out.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
    return out
