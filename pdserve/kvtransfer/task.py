"""`PrefillTask`: what a decode worker asks of the prefill pool, and its wire codec.

A task names the prompt, the positions to compute and the blocks to write
them into. It travels from the decode worker through the queue to a prefill
worker (the queue's wire carries it as `task_to_wire` makes it, never
pickle), and each result that comes back names it by (request_id, epoch).

Ordering: tasks leave the queue in (priority, deadline, arrival_time) order.
`priority` is a `pdserve.common.Priority` (HIGH=0, NORMAL=1, LOW=2; lower =
more urgent); a name ("high", any case) or an int is parsed into one. A task
without a deadline sorts after every task with one at the same priority.
Deadlines and arrival times are absolute unix seconds from the producer's
clock (hosts are assumed NTP-synchronised).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.common.priority import Priority

MAX_TRACEPARENT_CHARS = 128  # "00-<32 hex>-<16 hex>-<2 hex>" is 55; a future version may add fields


@dataclass
class PrefillTask:
    """One remote-prefill request, from a decode worker to the prefill pool.

    The prefill worker computes KV for positions [cached_len, len(token_ids))
    and writes it into `target_block_ids` of `target_worker_id`; the
    completion it sends carries (request_id, epoch), so the decode worker can
    ignore late results of an abandoned attempt. `origin` (default: the
    target) is where failed tasks are returned, via `take_failed(origin)`.
    `signature`: the target decode worker's Ed25519 signature over the task
    (`signing`); a prefill worker refuses a task without a valid one.
    `prefix_hint`: prefill worker id -> tokens of this prompt's prefix it holds cached, as
    the decode worker's view of their KV events says (cluster/kvindex/); the queue may keep the task
    for the worker with the longest one (cluster/queue/core.py). Advisory, so not signed: a
    wrong hint can only cost scheduling, never what is computed or where it is written.
    `traceparent`: the W3C trace context of the decode worker's request span when it traces
    (common/tracing.py), so the prefill worker's spans join the request's trace; "" when it
    does not (then the wire leaves it out: a worker of an earlier version reads the task).
    Advisory, so not signed.
    `lora_name`, `lora_int_id`, `lora_path`: the LoRA adapter the prompt runs under (vLLM's
    `LoRARequest`, engine/lora_request.py; "" = the base model). The prefill worker computes the
    KV under it, loading it from `lora_path` (the same host or a shared filesystem) when it does
    not hold it; the name keys the prefix cache on both sides. Signed (a path a prefill worker
    reads from disk must come from the decode worker that reserved the blocks); the wire leaves
    them out for the base model, so a base task reads and signs as before.
    `draft_block_ids`: where the decode worker's speculative draft model wants its KV of every
    prompt position (engine/spec_draft.py; the draft's own pool, kvtransfer/nixl/pools.py); a
    prefill worker with the same draft computes and writes it before the `PrefillDone`, one
    without leaves them (the done notice says how many positions it wrote). Signed when set (it
    says where a write lands); the wire leaves it out when empty.
    """

    request_id: str
    epoch: int
    token_ids: list[int]
    cached_len: int
    target_worker_id: str
    target_block_ids: list[int]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    priority: Priority = Priority.NORMAL  # a name ("high") or an int (0) is parsed
    deadline: float | None = None  # absolute unix time; None = no deadline
    arrival_time: float = field(default_factory=time.time)
    origin: str = ""
    signature: bytes = b""
    prefix_hint: dict[str, int] = field(default_factory=dict)
    traceparent: str = ""
    lora_name: str = ""
    lora_int_id: int = 0
    lora_path: str = ""
    draft_block_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.priority = Priority.parse(self.priority)  # ValueError naming the choices
        if not isinstance(self.prefix_hint, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in self.prefix_hint.items()):
            raise ValueError("prefix_hint must map worker ids to token counts (ints >= 0)")
        if not isinstance(self.traceparent, str) or len(self.traceparent) > MAX_TRACEPARENT_CHARS:
            raise ValueError(f"traceparent must be a W3C traceparent string (at most {MAX_TRACEPARENT_CHARS} "
                             "characters)")
        if not isinstance(self.signature, bytes):
            raise ValueError(f"signature must be bytes, got {type(self.signature).__name__}")
        if not 0 <= self.cached_len <= len(self.token_ids):
            raise ValueError(f"cached_len={self.cached_len} outside [0, {len(self.token_ids)}]")
        if not self.origin:
            self.origin = self.target_worker_id
        if not isinstance(self.lora_name, str) or not isinstance(self.lora_path, str):
            raise ValueError("lora_name and lora_path must be strings")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 0:
            raise ValueError(f"lora_int_id must be an int >= 0, got {self.lora_int_id!r}")
        if not isinstance(self.draft_block_ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.draft_block_ids):
            raise ValueError("draft_block_ids must be a list of block ids (ints >= 0)")
        if bool(self.lora_name) != bool(self.lora_path) or (not self.lora_name and self.lora_int_id):
            raise ValueError("lora_name, lora_int_id and lora_path name one adapter together (all set, or none)")

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.token_ids) - self.cached_len

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.epoch)

    def sort_key(self) -> tuple[int, float, float]:
        return (self.priority, math.inf if self.deadline is None else self.deadline, self.arrival_time)


TASK_FIELDS = tuple(f.name for f in fields(PrefillTask))
LORA_FIELDS = ("lora_name", "lora_int_id", "lora_path")


class TaskFormatError(ValueError):
    """A task's wire map is not a task (names the field)."""


def task_to_wire(task: PrefillTask) -> dict[str, Any]:
    """The task as a map of its fields. Shallow on purpose: `dataclasses.asdict` deep-copies
    every token id (~0.8 ms for a 512-token task). The priority packs as its int. An empty
    traceparent is left out (a task of a worker that does not trace reads as before), and so is
    the adapter of a base-model task."""
    out = {name: getattr(task, name) for name in TASK_FIELDS}
    if not task.traceparent:
        del out["traceparent"]
    if not task.lora_name:
        for name in LORA_FIELDS:
            del out[name]
    if not task.draft_block_ids:
        del out["draft_block_ids"]
    return out


def task_from_wire(body: Any, what: str = "task") -> PrefillTask:
    """The task a map describes; TaskFormatError naming the field for anything else (a bad
    value is the task's own ValueError: cached_len, priority, signature)."""
    if not isinstance(body, dict):
        raise TaskFormatError(f"{what}: expected a map, got {type(body).__name__}")
    unknown = sorted(str(k) for k in set(body) - set(TASK_FIELDS))
    if unknown:
        raise TaskFormatError(f"{what}: unknown field(s) {unknown}")
    try:
        return PrefillTask(**body)
    except TypeError as exc:
        raise TaskFormatError(f"{what}: {exc}") from None
