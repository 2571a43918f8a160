"""What a prefill worker's batches report: the worker's counters, each batch's result and the
tasks it could not deliver (prefill/batch.py fills them; the worker's metrics and stats read them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.kvtransfer.prefill_side import PrefillJob
from pdserve.kvtransfer.task import PrefillTask


@dataclass
class PrefillStats:
    """Counters of one prefill worker (get_stats, metrics)."""

    tasks_done: int = 0
    tasks_failed: int = 0
    batches: int = 0
    batches_failed: int = 0  # batches whose forward pass raised
    tokens_computed: int = 0
    bytes_written: int = 0
    layerwise_tasks: int = 0
    transfer_failures: int = 0  # page writes that failed or timed out
    failure_notices_sent: int = 0  # PrefillFailed over NIXL
    failed_by_kind: Counter = field(default_factory=Counter)
    # Tasks refused before any work: not signed by their target decode worker (prefill/auth.py)
    tasks_rejected: int = 0
    rejected_by_reason: Counter = field(default_factory=Counter)
    # Prefixes borrowed from other workers before a batch (prefill/loans.py `PrefixLoans.borrow`):
    # loans by outcome (read, refused, failed, timed_out) and the prompt tokens read, not computed.
    borrows: Counter = field(default_factory=Counter)
    borrowed_tokens: int = 0


@dataclass
class TaskFailure:
    """A task that will not be written; `notified`: a PrefillFailed went out over NIXL."""

    task: PrefillTask
    kind: str
    detail: str
    writes_settled: bool = True
    notified: bool = False


@dataclass
class BatchResult:
    done: int = 0
    failures: list[TaskFailure] = field(default_factory=list)
    batch_tokens: int = 0
    prefill_ms: float = 0.0
    num_tasks: int = 0
    jobs: list[PrefillJob] = field(default_factory=list)  # its admitted tasks, as they ended (their spans)
