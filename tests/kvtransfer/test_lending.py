"""A prefix lent across processes (kvtransfer/lend.py, kvtransfer/lending.py): two engines, each
with its own NIXL agent in its own process. The borrower reads the holder's cached prefix
and computes only the rest, token-exact; a refusal and a holder that dies with the loan
out fall back to computing it, token-exact, and no block stays taken on either side."""

from __future__ import annotations

import contextlib
import random
import time

import pytest
from lend_node import lend_node_main

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 64


def call(conn, op, timeout_s=120, **kwargs):
    conn.send({"op": op, **kwargs})
    assert conn.poll(timeout_s), f"no answer to {op}"
    return conn.recv()


@contextlib.contextmanager
def node(spawn_ctx, llama_dir, name, quarantine_s=1.0, lease_ms=4000, verify=False, **engine_args):
    parent, child = spawn_ctx.Pipe()
    proc = spawn_ctx.Process(target=lend_node_main, args=(child, llama_dir, name, NUM_BLOCKS, quarantine_s, lease_ms,
                                                          engine_args, verify), daemon=True)
    proc.start()
    try:
        yield parent, proc
    finally:
        if proc.is_alive():
            with contextlib.suppress(Exception):
                call(parent, "exit", timeout_s=30)
            proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def connected(a, b):
    """Each knows the other (a borrower reads from the holder; the holder answers it): the names
    a and b go by at the other."""
    name_b = call(a, "add_peer", info=call(b, "info")["info"])["name"]
    name_a = call(b, "add_peer", info=call(a, "info")["info"])["name"]
    return name_a, name_b


def settled_pool(conn, timeout_s=20.0):
    """The node's pool once no loan or quarantine holds anything."""
    deadline = time.monotonic() + timeout_s
    while True:
        pool = call(conn, "pool")
        if (pool["free"] == pool["blocks"] and not pool["lent"] and not pool["quarantined"]) \
                or time.monotonic() > deadline:
            return pool
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = LLM(llama_dir, enable_prefix_caching=False)
    yield lambda prompt: llm.generate([prompt], GREEDY)[0].token_ids
    llm.close()


def prompts(seed, shared_len=160, tail=40):
    rng = random.Random(seed)
    shared = [rng.randrange(5, 500) for _ in range(shared_len)]
    return shared, shared + [rng.randrange(5, 500) for _ in range(tail)]


def test_a_borrowed_prefix_is_read_not_computed_and_the_output_is_token_exact(spawn_ctx, llama_dir, reference):
    shared, prompt = prompts(1)
    with node(spawn_ctx, llama_dir, "holder") as (holder, _), node(spawn_ctx, llama_dir, "reader") as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=shared + [7, 7])  # the holder caches the 10 shared blocks
        call(reader, "generate", prompt=shared[:32])  # the reader holds the first two blocks itself
        got = call(reader, "borrow_generate", prompt=prompt, holder=holder_name, blocks=10)
        assert got["outcome"] == "read", got
        assert got["read_tokens"] == 8 * 16 and got["cached"] == 160  # read only what it lacked
        assert got["tokens"] == reference(prompt)
        for side in (holder, reader):
            pool = settled_pool(side)
            assert pool["free"] == pool["blocks"] and pool["lent"] == 0, pool
        # Released by the read's end, confirmed live (the borrower used the pages only then).
        assert call(holder, "pool")["lender"] == {"granted": 1, "released": 1, "confirmed": 1}
        assert call(reader, "pool")["borrower"] == {"asked": 1, "confirmed": 1, "read": 1}


def test_a_chain_the_holder_no_longer_has_is_refused_and_computed(spawn_ctx, llama_dir, reference):
    _, prompt = prompts(2)
    with node(spawn_ctx, llama_dir, "holder") as (holder, _), node(spawn_ctx, llama_dir, "reader") as (reader, _):
        holder_name, _ = connected(holder, reader)
        got = call(reader, "borrow_generate", prompt=prompt, holder=holder_name, blocks=10)
        assert got["outcome"] == "refused" and got["detail"] == "gone", got
        assert got["cached"] == 0 and got["tokens"] == reference(prompt)
        assert settled_pool(reader)["free"] == NUM_BLOCKS


def test_a_holder_killed_with_the_loan_out_leaves_the_borrower_computing_token_exact(spawn_ctx, llama_dir,
                                                                                      reference):
    shared, prompt = prompts(3)
    with node(spawn_ctx, llama_dir, "holder") as (holder, holder_proc), \
            node(spawn_ctx, llama_dir, "reader", quarantine_s=1.0, lease_ms=2000) as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=shared + [7, 7])
        call(holder, "die_after_grant")
        got = call(reader, "borrow_generate", prompt=prompt, holder=holder_name, blocks=10)
        holder_proc.join(10)
        assert holder_proc.exitcode is not None  # it died granting
        assert got["outcome"] in ("failed", "timed_out"), got
        assert got["cached"] == 0 and got["tokens"] == reference(prompt)
        pool = settled_pool(reader)
        assert pool["free"] == pool["blocks"] and pool["quarantined"] == 0, pool


def test_a_chain_partly_in_the_holders_second_tier_is_loaded_back_then_lent(spawn_ctx, llama_dir, reference,
                                                                            tmp_path):
    """The holder's pool evicted the tail of the shared prefix into its second tier (the
    cluster's index still lists it there): asked for the chain, the holder loads that part
    back into its pool, then grants; the borrower reads it all, token-exact."""
    shared, prompt = prompts(4)
    rng = random.Random(40)
    others = [[rng.randrange(5, 500) for _ in range(200)] for _ in range(5)]
    with node(spawn_ctx, llama_dir, "holder", kv_offload_bytes=1 << 24, kv_offload_path=str(tmp_path)) \
            as (holder, _), node(spawn_ctx, llama_dir, "reader") as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=shared + [7, 7])
        for other in others:  # 5 x 13 blocks through a 64-block pool: the shared prefix's tail is evicted
            call(holder, "generate", prompt=other)
        holds = call(holder, "holds", prompt=prompt)
        assert holds["pool"] < 160 and holds["pool"] + holds["tier"] == 160, holds
        got = call(reader, "borrow_generate", prompt=prompt, holder=holder_name, blocks=10)
        assert got["outcome"] == "read", got
        assert got["read_tokens"] == 160 and got["cached"] == 160
        assert got["tokens"] == reference(prompt)
        for side in (holder, reader):
            pool = settled_pool(side)
            assert pool["free"] == pool["blocks"] and pool["lent"] == 0, pool
        counters = call(holder, "pool")["lender"]
        assert counters == {"loading_from_tier": 1, "granted_from_tier": 1, "granted": 1, "released": 1,
                            "confirmed": 1}, counters
