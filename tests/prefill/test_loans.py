"""A lending prefill worker answers loans on every poll of its transport (prefill/loans.py
`PrefixLoans.poll`), the batch's own polls too (`PrefillBatch` drives the transport through the
`poll` it is built with): the lend traffic goes to its `Lending` first, the rest is returned."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from pdserve.common.compute_thread import ComputeProgress
from pdserve.kvtransfer.lend import LendRequest
from pdserve.kvtransfer.lending import Lending
from pdserve.kvtransfer.nixl.tp_sender import TPSender
from pdserve.kvtransfer.nixl.transfer import Notification, PollResult
from pdserve.prefill.batch import PrefillBatch
from pdserve.prefill.loans import PrefixLoans
from pdserve.prefill.values import PrefillStats


class Agent:
    """Rank 0's agent: every poll returns `res` (once), and it records what it sent."""

    def __init__(self, res: PollResult):
        self.res, self.sent, self.polls = res, [], 0

    def add_peer(self, info) -> str:
        return info["name"]

    def poll(self) -> PollResult:
        self.polls += 1
        res, self.res = self.res, PollResult()
        return res

    def send_notification(self, peer: str, payload: bytes) -> None:
        self.sent.append((peer, payload))


class Pool:
    """An engine that caches nothing (every loan is refused)."""

    def lend_chain(self, tail_hash, num_blocks):
        return None

    def load_chain(self, tail_hash, num_blocks, key):
        return None

    def finish_tier_loads(self) -> None:
        pass


def _loans(res: PollResult) -> tuple[PrefixLoans, Agent]:
    agent = Agent(res)
    sender = TPSender(agent, num_kv_heads=2)
    sender.add_peer({"name": "borrower"})
    lending = Lending(Pool(), sender)
    loans = PrefixLoans("p0", engine=None, sender=sender, lending=lending, peers=None, costs=None,
                        stats=PrefillStats(), compute=None, lock=threading.Lock())
    return loans, agent


def _asked_and_mine() -> tuple[Notification, Notification]:
    ask = Notification("borrower", LendRequest("l1", b"h" * 16, 2, 4000).encode())
    return ask, Notification("d", b"a notice of the worker's own")


def test_a_lending_workers_poll_answers_the_loans_and_returns_the_rest():
    ask, mine = _asked_and_mine()
    completed = [object()]
    loans, agent = _loans(PollResult(completed=completed, notifications=[ask, mine]))
    res = loans.poll()
    assert res.notifications == [mine] and res.completed == completed
    assert loans.lending.lender.counters["refused_gone"] == 1 and [p for p, _ in agent.sent] == ["borrower"]


def test_a_batchs_own_polls_answer_the_loans():
    ask, mine = _asked_and_mine()
    loans, agent = _loans(PollResult(notifications=[ask, mine]))
    engine = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=64))
    batch = PrefillBatch("p0", engine, loans.sender, PrefillStats(), transfer_timeout_s=1.0, layerwise=False,
                         progress=ComputeProgress(), poll=loans.poll, between_steps=loans.between_steps)
    batch.run([], {})  # an empty batch still drives the transport once (its notices go out)
    assert agent.polls == 1 and loans.lending.lender.counters["refused_gone"] == 1
    assert [p for p, _ in agent.sent] == ["borrower"]
