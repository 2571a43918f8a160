"""When a decode worker borrows a prefix for a local prefill (decode/borrow.py `choose`): only
from a worker whose record says it lends, only two blocks or more past what this pool and its
second tier hold, and only when the read is predicted cheaper than computing."""

from __future__ import annotations

import dataclasses
import types

from pdserve.decode.borrow import PeerPrefixes
from pdserve.router.costs import CostEstimates


def peers(lenders=("prefill-0", "prefill-1")):
    engine = types.SimpleNamespace(engine=types.SimpleNamespace(config=types.SimpleNamespace(block_size=16)))
    p = PeerPrefixes(engine, lending=None, agent=None, fetch_metadata=None)
    for w in lenders:
        p.member(types.SimpleNamespace(worker_id=w, capacity={"lends_prefixes": True}))
    return p


COSTS = CostEstimates(prefill_local_ms_per_token=0.1, prefill_remote_ms_per_token=0.1, decode_ms_per_token=1.0,
                      decode_step_ms=20.0, transfer_bytes_per_ms=1e7, transfer_setup_ms=2.0,
                      kv_bytes_per_token=6144)


def test_the_longest_lent_prefix_is_borrowed_when_reading_it_is_cheaper():
    p = peers()
    assert p.choose({"prefill-0": 320, "prefill-1": 160}, 0, 400, COSTS) == ("prefill-0", 20)
    # Capped at the prompt's full blocks before its last token.
    assert p.choose({"prefill-0": 512}, 0, 321, COSTS) == ("prefill-0", 20)


def test_no_borrow_from_a_worker_that_does_not_lend_or_for_what_is_held_here():
    p = peers(lenders=("prefill-1",))
    assert p.choose({"prefill-0": 320}, 0, 400, COSTS) is None  # its record does not say it lends
    p.member(types.SimpleNamespace(worker_id="prefill-1", capacity={}))  # it stopped lending
    assert p.choose({"prefill-1": 320}, 0, 400, COSTS) is None
    q = peers()
    assert q.choose({"prefill-0": 320}, 304, 400, COSTS) is None  # one block more than this pool: not worth it
    assert q.choose({"prefill-0": 320}, 0, 400, COSTS, tier_len=300) is None  # the tier holds it: load instead
    q.gone(types.SimpleNamespace(worker_id="prefill-0"))
    assert q.choose({"prefill-0": 320}, 0, 400, COSTS) is None


def test_no_borrow_when_the_read_is_predicted_dearer_than_the_compute():
    slow = dataclasses.replace(COSTS, transfer_bytes_per_ms=100.0)
    assert peers().choose({"prefill-0": 320}, 0, 400, slow) is None
