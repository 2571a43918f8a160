"""The decode-side handoff state machine, transition by transition (no Ray, etcd, NIXL or engine)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.decode_side import TRANSITIONS, Effect, Handoffs, HandoffState

S, E = HandoffState, Effect


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def table(clock):
    return Handoffs(quarantine_s=60.0, clock=clock)


def queued(table, rid="r1", epoch=1):
    table.reserve(rid, epoch, num_blocks=4)
    assert table.queued(rid, epoch, task="the task").effect is E.NOTHING
    return table.awaited(rid)


def test_the_transition_table_is_exactly_the_documented_one():
    awaited = (S.RESERVED, S.QUEUED)
    expected = {(S.RESERVED, "queued"): (S.QUEUED, E.NOTHING)}
    for s in awaited:
        expected[(s, "done")] = (S.READY, E.RUN)
        expected[(s, "fail_settled")] = (S.FALLEN_BACK, E.FALL_BACK)
        expected[(s, "fail_unsettled")] = (S.QUARANTINED, E.FALL_BACK_QUARANTINE)
        expected[(s, "abort_settled")] = (S.ABORTED, E.ABORT)
        expected[(s, "abort_unsettled")] = (S.QUARANTINED, E.ABORT_QUARANTINE)
        expected[(s, "supersede")] = (S.QUARANTINED, E.REPLACE)
    for event in ("done", "fail_settled", "expire"):
        expected[(S.QUARANTINED, event)] = (S.RELEASED, E.FREE)
    assert TRANSITIONS == expected


def test_reserved_then_queued_then_done_runs_the_request(table):
    h = table.reserve("r1", 1, num_blocks=4)
    assert h.state is S.RESERVED and table.num_awaiting == 1
    table.queued("r1", 1, task="the task")
    assert h.state is S.QUEUED and h.task == "the task"
    step = table.done("r1", 1)
    assert step.effect is E.RUN and step.handoff is h and h.state is S.READY
    assert table.awaiting() == [] and len(table) == 0  # nothing left to hold
    assert h.history == ["reserved --queued--> queued", "queued --done--> ready"]


def test_done_before_the_put_returned_runs_the_request(table):
    table.reserve("r1", 1, num_blocks=2)
    assert table.done("r1", 1).effect is E.RUN
    assert table.queued("r1", 1).stale  # the put's late answer changes nothing


@pytest.mark.parametrize("reserved_only", [True, False])
def test_a_settled_failure_falls_back_and_releases(table, reserved_only):
    if reserved_only:
        h = table.reserve("r1", 1, num_blocks=2)
    else:
        h = queued(table)
    step = table.failed("r1", 1, writes_settled=True, why="transfer_error on p0: boom")
    assert step.effect is E.FALL_BACK and h.state is S.FALLEN_BACK
    assert h.reason == "transfer_error on p0: boom" and len(table) == 0


def test_an_unsettled_failure_quarantines_until_the_late_done(table, clock):
    h = queued(table)
    step = table.failed("r1", 1, writes_settled=False, why="transfer_timeout")
    assert step.effect is E.FALL_BACK_QUARANTINE and h.state is S.QUARANTINED
    assert h.quarantine_key == "r1#quarantine1" and h.quarantine_until == clock.now + 60.0
    assert table.num_awaiting == 0 and table.quarantined() == [h]
    late = table.done("r1", 1)  # the attempt's write is over: its blocks are safe to reuse
    assert late.effect is E.FREE and late.handoff is h and h.state is S.RELEASED and len(table) == 0


def test_a_quarantine_ends_by_a_settled_failure_but_not_an_unsettled_one(table):
    h = queued(table)
    table.give_up("r1", 1, release_now=False, why="deadline passed")
    assert table.failed("r1", 1, writes_settled=False).stale and h.state is S.QUARANTINED
    assert table.failed("r1", 1, writes_settled=True).effect is E.FREE and h.state is S.RELEASED


@pytest.mark.parametrize("release_now, effect, state", [
    (True, E.FALL_BACK, S.FALLEN_BACK), (False, E.FALL_BACK_QUARANTINE, S.QUARANTINED)])
def test_giving_up_falls_back_releasing_or_quarantining(table, release_now, effect, state):
    h = table.reserve("r1", 1, num_blocks=3)
    step = table.give_up("r1", 1, release_now=release_now, why="deadline passed")
    assert step.effect is effect and h.state is state and h.reason == "deadline passed"
    assert table.give_up("r1", 1, release_now=False, why="deadline passed").stale  # a second deadline
    # Learning later that nobody can write (the queue failed the task back) ends a quarantine.
    again = table.give_up("r1", 1, release_now=True, why="queue: expired")
    assert again.effect is (E.NONE if release_now else E.FREE)


def test_quarantine_expires_only_after_its_time(table, clock):
    h = queued(table)
    table.give_up("r1", 1, release_now=False, why="deadline passed")
    clock.now += 59.0
    assert table.expire() == [] and h.state is S.QUARANTINED
    clock.now += 2.0
    [step] = table.expire()
    assert step.effect is E.FREE and step.handoff is h and h.state is S.RELEASED and len(table) == 0
    assert table.done("r1", 1).stale  # the write never came: a notice now is stale


@pytest.mark.parametrize("writer, effect, state", [
    (False, E.ABORT, S.ABORTED), (True, E.ABORT_QUARANTINE, S.QUARANTINED)])
def test_abort_releases_or_quarantines(table, writer, effect, state):
    h = queued(table)
    step = table.abort("r1", writer_may_exist=writer)
    assert step.effect is effect and h.state is state and table.num_awaiting == 0


def test_a_late_done_after_a_released_fallback_is_stale(table):
    queued(table)
    table.failed("r1", 1, writes_settled=True)
    step = table.done("r1", 1)
    assert step.stale and step.effect is E.NONE and table.counts["stale"] == 1


def test_an_epoch_mismatch_is_stale_and_keeps_the_attempt(table):
    h = queued(table)
    assert table.done("r1", 2).stale
    assert table.failed("r1", 0, writes_settled=True).stale
    assert h.state is S.QUEUED and table.awaited("r1") is h


def test_a_new_attempt_can_start_while_the_old_one_is_quarantined(table):
    old = queued(table)
    table.give_up("r1", 1, release_now=False, why="deadline passed")
    new = table.reserve("r1", 2, num_blocks=4)
    assert table.awaited("r1") is new and old.state is S.QUARANTINED
    assert table.done("r1", 1).effect is E.FREE  # the old attempt's late write ends its quarantine
    assert new.state is S.RESERVED and table.done("r1", 2).effect is E.RUN


def test_one_awaited_attempt_per_request(table):
    table.reserve("r1", 1, num_blocks=1)
    with pytest.raises(ValueError, match="already awaits"):
        table.reserve("r1", 2, num_blocks=1)
    table.give_up("r1", 1, release_now=False, why="x")
    with pytest.raises(ValueError, match="still held"):
        table.reserve("r1", 1, num_blocks=1)


def test_abort_of_a_request_without_an_attempt_is_a_no_op_not_stale(table):
    step = table.abort("local-only", writer_may_exist=True)
    assert step.effect is E.NONE and "stale" not in table.counts


def test_a_done_is_checked_against_the_live_attempt_and_its_signed_task(table):
    from types import SimpleNamespace

    from pdserve.kvtransfer.decode_side import UNKNOWN_ATTEMPT, WRONG_SIZE

    table.reserve("r1", 1, num_blocks=4)
    table.queued("r1", 1, task=SimpleNamespace(num_prefill_tokens=50))
    assert table.check_done("r1", 1, 50) is None
    assert table.check_done("r1", 1, 64) == WRONG_SIZE  # claims other positions than it was asked for
    assert table.check_done("r1", 2, 50) == UNKNOWN_ATTEMPT  # an epoch never started
    assert table.check_done("nobody", 1, 50) == UNKNOWN_ATTEMPT
    assert table.awaited("r1").state is S.QUEUED  # checking changes nothing
    table.done("r1", 1)
    assert table.check_done("r1", 1, 50) == UNKNOWN_ATTEMPT  # over: a second done is refused
