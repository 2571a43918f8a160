"""What a request's writes and reads over several ranks (kvtransfer/nixl/tp_handles.py) make of
a TP group that broke: `TPGroup.fail` stopped the other ranks, so their part is over (it can
no longer land) and the request's failure is settled; a control request that fails while the
group is whole is still an error."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.nixl.errors import TransferError
from pdserve.kvtransfer.nixl.ranks import PeerRanks
from pdserve.kvtransfer.nixl.tp_handles import TPRead, TPStream
from pdserve.kvtransfer.nixl.tp_sender import TPSender


class Group:
    def __init__(self, broken: str | None, undelivered=()):
        self.broken = broken
        self.undelivered = list(undelivered)
        self.calls: list[str] = []

    def call(self, op, **args):
        self.calls.append(op)
        raise RuntimeError("tensor-parallel group is broken" if self.broken else "rank 1: no such key")


def stream(broken, undelivered=()):
    group = Group(broken, undelivered)
    sender = TPSender(agent=None, num_kv_heads=2, tp=2, group=group)
    return TPStream(sender, 1, PeerRanks("d", 1, ({"name": "d"},)), [], others=True), group


@pytest.mark.parametrize("sent", [True, False])
def test_a_broken_group_fails_the_finish_and_settles_only_writes_never_sent(sent):
    """The step carrying the stream reached the stopped rank: its writes may still land (no
    vouching for them). Its sending failed: the rank never posted any."""
    undelivered = [] if sent else [{"kind": "stream", "key": 1}]
    s, group = stream("tensor-parallel rank 1 exited with code -9", undelivered)
    s.abort()  # does not raise: the ranks are stopped
    assert s.settle_posts(1.0) is (not sent)
    with pytest.raises(TransferError, match="rank 1: the rank was stopped"):
        s.finish(1.0)
    assert group.calls == ["abort", "settle", "finish"]


def test_a_step_that_could_not_be_sent_keeps_its_attachments_as_undelivered():
    from pdserve.engine.tp_group import TPGroup

    group = TPGroup.__new__(TPGroup)
    group.broken, group.undelivered, group._attachments, group.procs = "rank 1 exited", [], [], []
    group.attach({"kind": "stream", "key": 7})
    with pytest.raises(RuntimeError, match="broken"):
        group.send_step(None)
    assert group.undelivered == [{"kind": "stream", "key": 7}] and group._attachments == []


def test_a_failing_control_request_on_a_whole_group_is_an_error():
    s, _ = stream(None)
    with pytest.raises(RuntimeError, match="no such key"):
        s.abort()
    with pytest.raises(RuntimeError, match="no such key"):
        s.settle_posts(1.0)


@pytest.mark.parametrize("broken,finished", [("rank 1 exited", True), (None, False)])
def test_a_read_whose_ranks_cannot_be_asked_fails_and_is_over_only_if_they_were_stopped(broken, finished):
    group = Group(broken)
    sender = TPSender(agent=None, num_kv_heads=2, tp=2, group=group)
    read = TPRead(sender, 3, PeerRanks("h", 2, ({"name": "h"}, {"name": "h.r1"})), [], others={1: {"finished": False}})
    read.refresh()
    assert read.failed and read.finished is finished  # unfinished: the borrower quarantines its targets
    assert not read.done
