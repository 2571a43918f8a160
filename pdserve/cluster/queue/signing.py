"""Task signatures: a prefill worker writes only into blocks the target decode worker reserved.

Whoever can put a task on the queue (a process holding the wire's token, or a Ray
handle on the actor) chooses every field of it, and two of them say where a
prefill worker writes KV pages: `target_worker_id` and `target_block_ids`. So
the queue is not trusted to vouch for a task. Each decode worker makes an
Ed25519 key pair when it starts (`TaskSigner`), publishes the public key in its
etcd worker record (`WorkerInfo.task_key`) and signs every task it puts. A
prefill worker checks the signature against the key of the task's
`target_worker_id` (`verify_task`) before it computes or writes anything; a
task that fails is dropped and counted, and nobody is notified (a notice could
only help a forger: see prefill/worker.py).

What is signed (`signed_message`): a context string, then the msgpack of every
field a prefill worker acts on, in a fixed order with maps sorted by key:
request_id, epoch, target_worker_id, target_block_ids, cached_len, the number
of token ids and the SHA-256 of them as little-endian int64s, sampling_params,
priority, deadline and origin; then, for a task under a LoRA adapter only, its name, id and
path (a base-model task's message is unchanged). Not `arrival_time` (a statistic) and not the
signature itself. Never pickle.

Replay: a signed task must carry a deadline, and the signature covers it. The
queue refuses to take back a task it has already settled (completed, failed
back, cancelled) until that deadline passes, and refuses any task past its
deadline (`core.QueueCore`), so a copy of a signed task cannot be put again to
write blocks that have since been handed to another request.

Cost (bench/queue_latency.py prints it): signing and verifying a 2k-token
task take tens of microseconds each, so it is always on.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import struct
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pdserve.kvtransfer.task import PrefillTask

SIGNATURE_CONTEXT = b"pdserve prefill task v1\x00"  # a signature over a task is good for nothing else

# Why a prefill worker refused a task (the metric's `reason` label).
UNSIGNED, NO_KEY, NO_DEADLINE, BAD_SIGNATURE = "unsigned", "no_key", "no_deadline", "bad_signature"
REJECT_REASONS = (UNSIGNED, NO_KEY, NO_DEADLINE, BAD_SIGNATURE)


def _canonical(value: Any) -> Any:
    """`value` with every map as a list of [key, value] pairs sorted by key: one encoding per value."""
    if isinstance(value, dict):
        return [[k, _canonical(v)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def signed_message(task: PrefillTask) -> bytes:
    """The bytes a task's signature covers (TypeError or struct.error for a field that has no
    encoding: a token id that is not an int64, a value msgpack cannot pack)."""
    ids = task.token_ids
    tokens = hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).digest()  # 3x faster than msgpack here
    body = [task.request_id, task.epoch, task.target_worker_id, task.target_block_ids, task.cached_len,
            len(task.token_ids), tokens, _canonical(task.sampling_params), int(task.priority), task.deadline,
            task.origin]
    if task.lora_name:  # (the adapter a prefill worker loads from its path: signed)
        body += [task.lora_name, task.lora_int_id, task.lora_path]
    if task.draft_block_ids:  # (where the draft's pages land: signed)
        body += [["draft", task.draft_block_ids]]
    return SIGNATURE_CONTEXT + msgpack.packb(body, use_bin_type=True)


class TaskSigner:
    """One decode worker's task key pair (made at start, never stored): signs the tasks it puts.
    `public_key` (base64 of the raw 32 bytes) is what its etcd record publishes."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes_raw()
        self.public_key = base64.b64encode(raw).decode()

    def sign(self, task: PrefillTask) -> PrefillTask:
        """Set `task.signature` (after the last change to the task) and return the task."""
        if task.deadline is None:
            raise ValueError(f"task {task.request_id}: a signed task needs a deadline (it bounds replays)")
        task.signature = self._key.sign(signed_message(task))
        return task


@functools.lru_cache(maxsize=1024)
def load_public_key(text: str) -> Ed25519PublicKey:
    """A published task key; ValueError if it is not base64 of 32 bytes."""
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not an Ed25519 public key in base64: {exc}") from None


def verify_task(task: PrefillTask, public_key: str | None) -> str | None:
    """None when `task` is signed by the holder of `public_key` (the target's published key),
    else the reason it is not (one of REJECT_REASONS)."""
    if not isinstance(task.signature, bytes) or not task.signature:
        return UNSIGNED
    if not public_key:
        return NO_KEY
    if task.deadline is None:
        return NO_DEADLINE
    try:
        key = load_public_key(public_key)
    except ValueError:
        return NO_KEY
    try:
        key.verify(task.signature, signed_message(task))
    except (InvalidSignature, TypeError, ValueError, struct.error):  # a field with no encoding
        return BAD_SIGNATURE
    return None
