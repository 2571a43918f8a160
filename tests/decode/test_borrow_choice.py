"""When a decode worker borrows a prefix for a local prefill (decode/borrow.py `choose`): only
from a worker whose record says it lends and that this worker has met, only two blocks or more
past what this pool and its second tier hold, and only when the read is predicted cheaper than
computing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types

from pdserve.decode.borrow import PeerPrefixes
from pdserve.router.costs import CostEstimates


class Agent:
    """The NIXL agent's peer table (kvtransfer/nixl/agent.py): what ``add_peer`` registers."""

    def __init__(self):
        self.peers: dict[str, dict] = {}

    def add_peer(self, info: dict) -> None:
        self.peers[info["name"]] = info


async def peers(lenders=("prefill-0", "prefill-1"), records=None):
    """PeerPrefixes over the agent's table, its engine thread calls run at once, and etcd's NIXL
    records given by ``records`` (default: every worker has one); the lenders' records are seen."""
    engine = types.SimpleNamespace(block_size=16, call=lambda fn: fn(None))  # the AsyncEngine's view
    records = {f"prefill-{i}": {"name": f"prefill-{i}"} for i in range(3)} if records is None else records

    async def fetch(worker_id):
        return json.dumps(records[worker_id]).encode() if worker_id in records else None

    p = PeerPrefixes(engine, lending=None, agent=Agent(), fetch_metadata=fetch)
    for w in lenders:
        p.member(types.SimpleNamespace(worker_id=w, capacity={"lends_prefixes": True}))
    await settle(p)
    return p


async def settle(p: PeerPrefixes) -> None:
    for _ in range(100):  # the meetings under way (each a lookup and an engine call)
        if not p._meeting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"meetings still under way: {sorted(p._meeting)}")


COSTS = CostEstimates(prefill_local_ms_per_token=0.1, prefill_remote_ms_per_token=0.1, decode_ms_per_token=1.0,
                      decode_step_ms=20.0, transfer_bytes_per_ms=1e7, transfer_setup_ms=2.0,
                      kv_bytes_per_token=6144)


async def test_the_longest_lent_prefix_is_borrowed_when_reading_it_is_cheaper():
    p = await peers()
    assert set(p.agent.peers) == {"prefill-0", "prefill-1"}  # met as their records appeared
    assert p.choose({"prefill-0": 320, "prefill-1": 160}, 0, 400, COSTS) == ("prefill-0", 20)
    # Capped at the prompt's full blocks before its last token.
    assert p.choose({"prefill-0": 512}, 0, 321, COSTS) == ("prefill-0", 20)


async def test_no_borrow_from_a_worker_that_does_not_lend_or_for_what_is_held_here():
    p = await peers(lenders=("prefill-1",))
    assert p.choose({"prefill-0": 320}, 0, 400, COSTS) is None  # its record does not say it lends
    p.member(types.SimpleNamespace(worker_id="prefill-1", capacity={}))  # it stopped lending
    assert p.choose({"prefill-1": 320}, 0, 400, COSTS) is None
    q = await peers()
    assert q.choose({"prefill-0": 320}, 304, 400, COSTS) is None  # one block more than this pool: not worth it
    assert q.choose({"prefill-0": 320}, 0, 400, COSTS, tier_len=300) is None  # the tier holds it: load instead
    q.gone(types.SimpleNamespace(worker_id="prefill-0"))
    assert q.choose({"prefill-0": 320}, 0, 400, COSTS) is None


async def test_no_borrow_when_the_read_is_predicted_dearer_than_the_compute():
    slow = dataclasses.replace(COSTS, transfer_bytes_per_ms=100.0)
    assert (await peers()).choose({"prefill-0": 320}, 0, 400, slow) is None


async def test_a_holder_not_yet_met_is_not_asked_but_met_for_the_next_request():
    """Meeting a peer (an etcd read, an engine step) must not sit inside a request's loan wait:
    a lender whose record had no NIXL metadata yet is skipped, then met in the background."""
    records = {"prefill-0": {"name": "prefill-0"}}
    p = await peers(lenders=("prefill-0", "prefill-1"), records=records)
    assert set(p.agent.peers) == {"prefill-0"}  # prefill-1 published its record before its NIXL metadata
    records["prefill-1"] = {"name": "prefill-1"}
    assert p.choose({"prefill-1": 320}, 0, 400, COSTS) is None  # unmet: computed, not waited for
    await settle(p)
    assert "prefill-1" in p.agent.peers
    assert p.choose({"prefill-1": 320}, 0, 400, COSTS) == ("prefill-1", 20)
    assert p.counters["peer_lookup_failures"] == 1
