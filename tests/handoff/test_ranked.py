"""Notices between TP ranks (kvtransfer/ranked.py): the wrapper, and one PrefillDone per attempt
handed on only once every decode rank heard from all of its sources."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer import MalformedNoticeError, PrefillDone, PrefillFailed
from pdserve.kvtransfer.head_plan import write_plan
from pdserve.kvtransfer.ranked import RankedArrivals, decode_ranked, wrap

DONE = PrefillDone("r1", 3, 42, -0.5, 37).encode()


def pairs(heads: int, p_tp: int, d_tp: int) -> list[tuple[int, int]]:
    plan = write_plan(heads, p_tp, d_tp)
    return sorted({(w.src_rank, w.dst_rank) for w in plan.writes})


def test_the_wrapper_round_trips_and_refuses_what_it_cannot_carry():
    n = decode_ranked(wrap(DONE, 1, 2, 3, 4))
    assert (n.src_rank, n.src_tp, n.dst_rank, n.dst_tp, n.inner) == (1, 2, 3, 4, DONE)
    with pytest.raises(ValueError, match="outside TP sizes"):
        wrap(DONE, 2, 2, 0, 1)
    with pytest.raises(ValueError, match="cap"):
        wrap(b"x" * 1020, 0, 1, 0, 1)
    with pytest.raises(MalformedNoticeError, match="version"):
        decode_ranked(b"PDKR" + bytes([9, 0, 1, 0, 1]) + DONE)
    with pytest.raises(MalformedNoticeError, match="outside"):
        decode_ranked(b"PDKR" + bytes([1, 3, 2, 0, 1]) + DONE)


@pytest.mark.parametrize("heads,p_tp,d_tp", [(8, 2, 1), (8, 1, 4), (2, 4, 2), (1, 4, 4), (8, 4, 8)])
def test_a_prefill_done_is_handed_on_once_when_every_pair_arrived(heads, p_tp, d_tp):
    arrivals = RankedArrivals(heads, decode_tp=d_tp)
    todo = pairs(heads, p_tp, d_tp)
    out = []
    for i, (src, dst) in enumerate(reversed(todo)):  # any order
        out.append(arrivals.feed(wrap(DONE, src, p_tp, dst, d_tp), now=0.0))
        if i == 0:
            assert arrivals.feed(wrap(DONE, src, p_tp, dst, d_tp), now=0.0) is None  # a duplicate
    assert out[:-1] == [None] * (len(todo) - 1) and out[-1] == DONE
    assert arrivals.completed == 1 and arrivals.duplicates == 1 and arrivals.waiting() == {}
    # A late duplicate after completion opens a new entry that never completes; it ages out.
    src, dst = todo[0]
    if len(todo) > 1:
        assert arrivals.feed(wrap(DONE, src, p_tp, dst, d_tp), now=1.0) is None
        arrivals.feed(PrefillFailed("other", 1, "transfer_error", "x", "p", True).encode(), now=1000.0)
        assert arrivals.waiting() == {} and arrivals.dropped == 1


def test_plain_notices_pass_and_a_failure_drops_what_was_gathered():
    arrivals = RankedArrivals(8, decode_tp=2)
    assert arrivals.feed(DONE) == DONE  # single-rank peers: untouched
    assert arrivals.feed(wrap(DONE, 0, 2, 0, 2)) is None
    assert list(arrivals.waiting()) == [("r1", 3)]
    assert arrivals.waiting()[("r1", 3)] == {1: [1]}
    failed = PrefillFailed("r1", 3, "transfer_error", "rank 1's link went down", "p", True).encode()
    assert arrivals.feed(failed) == failed
    assert arrivals.waiting() == {} and arrivals.dropped == 1


def test_notices_for_another_decode_tp_or_an_impossible_plan_are_counted_not_used():
    arrivals = RankedArrivals(8, decode_tp=2)
    assert arrivals.feed(wrap(DONE, 0, 1, 0, 4)) is None  # meant for a TP=4 decode worker
    assert arrivals.feed(wrap(DONE, 0, 3, 0, 2)) is None  # 8 heads over 3 prefill ranks: no plan
    assert arrivals.unexpected == 2 and arrivals.waiting() == {}
    with pytest.raises(MalformedNoticeError):
        arrivals.feed(b"garbage")


def test_open_attempts_are_bounded():
    arrivals = RankedArrivals(8, decode_tp=2, max_pending=3)
    for i in range(5):
        arrivals.feed(wrap(PrefillDone(f"r{i}", 1, 1, None, 1).encode(), 0, 2, 0, 2))
    assert [k for k, _ in arrivals.waiting()] == ["r2", "r3", "r4"] and arrivals.dropped == 2
