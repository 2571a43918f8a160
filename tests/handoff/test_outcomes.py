"""The failure table (kvtransfer/outcomes.py): what each reason means, and who may send it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdserve.kvtransfer import PrefillFailed, decode_notification
from pdserve.kvtransfer.outcomes import FAILURES, PREFILL, PREFILL_FAILURE_KINDS, QUEUE, fallback_reason, is_settled

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", PREFILL_FAILURE_KINDS)
def test_every_prefill_kind_travels_in_a_prefill_failed(kind):
    msg = decode_notification(PrefillFailed("r", 1, kind, "why", "p0").encode())
    assert msg.kind == kind


def test_a_queue_reason_is_not_a_prefill_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        PrefillFailed("r", 1, "worker_vanished")


def test_an_unknown_reason_is_not_settled_and_reads_as_the_queues():
    assert not is_settled("something_newer")
    assert fallback_reason("something_newer", "d") == "queue: something_newer"


def test_the_fallback_reason_names_prefill_kinds_and_a_stalled_worker():
    assert fallback_reason("bad_task", "NaN temperature") == "bad_task: NaN temperature"
    assert fallback_reason("worker_stalled", "p0 silent") == "worker_stalled: p0 silent"
    assert fallback_reason("deadline_expired", "after 5 s") == "queue: deadline_expired"


def test_every_reason_the_queue_gives_is_in_the_table():
    """The queue's core fails tasks with the table's constants only (a new reason needs a row)."""
    tree = ast.parse((ROOT / "cluster/queue/core.py").read_text())
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_fail"]
    used = {n.id for call in calls for arg in call.args[1:] for n in ast.walk(arg)
            if isinstance(n, ast.Name) and n.id.isupper()}
    assert {"DEADLINE_EXPIRED", "WORKER_VANISHED", "WORKER_STALLED"} <= used, used
    from pdserve.kvtransfer import outcomes
    reasons = {name for name in used if not name.startswith("MAX_")}  # (not the detail's length cap)
    names = {getattr(outcomes, name) for name in reasons}
    assert names <= {k.name for k in FAILURES.values() if k.raised_by == QUEUE}, names


def test_every_kind_a_prefill_worker_sends_is_one_of_its_rows():
    assert set(PREFILL_FAILURE_KINDS) == {k.name for k in FAILURES.values() if k.raised_by == PREFILL}
    assert all(k.meaning for k in FAILURES.values())
