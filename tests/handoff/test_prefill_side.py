"""The prefill side's state machine (kvtransfer/prefill_side.py): its table and its events."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer import CANCELLED, TRANSFER_ERROR, JobState, PrefillJob, PrefillTask
from pdserve.kvtransfer.prefill_side import TRANSITIONS

S = JobState


def job() -> PrefillJob:
    return PrefillJob(PrefillTask("r1", 2, [1, 2, 3, 4], 0, "d0", [5]), "r1#2")


class Stream:
    finished = False
    aborted = False

    def abort(self):
        self.finished = self.aborted = True


def test_the_table_ends_every_path_in_done_or_failed():
    """Every non-final state can fail; nothing leaves a final state; DONE is reached only by a write."""
    for state in JobState:
        outgoing = {event for (s, event) in TRANSITIONS if s is state}
        assert ("fail" in outgoing) is (not state.final), state
        assert not (state.final and outgoing), state
    assert [k for k, v in TRANSITIONS.items() if v is S.DONE] == [(S.POSTED, "written")]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_job_that_is_written_passes_every_state_in_order(streamed):
    j = job()
    assert j.key == ("r1", 2) and j.state.computing
    if streamed:
        assert j.streaming(Stream())
    assert j.computed(9, -0.5) and not j.state.computing and j.first == (9, -0.5, ())
    assert j.posted(["h"]) and j.handles == ["h"]
    assert j.written() and j.state is S.DONE
    assert j.history[-1] == "posted --written--> done"
    assert not j.fail(TRANSFER_ERROR, "too late") and j.failure is None  # a done job stays done


def test_events_out_of_order_change_nothing():
    j = job()
    assert not j.posted([]) and not j.written()  # nothing computed yet
    assert j.computed(1, None)
    assert not j.computed(2, None) and j.first == (1, None, ())  # the first token stays
    assert not j.streaming(Stream())  # too late to stream
    assert j.state is S.COMPUTED and len(j.history) == 1


def test_a_failure_keeps_its_first_cause_aborts_the_stream_and_remembers_a_write_in_flight():
    j, stream = job(), Stream()
    j.streaming(stream)
    assert j.fail(CANCELLED, "its decode worker aborted it")
    assert stream.aborted and j.state is S.FAILED and not j.write_may_land
    assert not j.fail(TRANSFER_ERROR, "a write timed out", write_may_land=True)
    assert j.failure == (CANCELLED, "its decode worker aborted it")
    assert j.write_may_land  # the timed-out write still counts when the notice says what is settled


@pytest.mark.parametrize("at", ["admitted", "computed", "posted"])
def test_a_job_can_fail_at_every_stage_before_done(at):
    j = job()
    if at != "admitted":
        j.computed(1, None)
    if at == "posted":
        j.posted(["h"])
    assert j.fail(TRANSFER_ERROR, "x") and j.state is S.FAILED
    assert j.history[-1] == f"{at} --fail--> failed"
