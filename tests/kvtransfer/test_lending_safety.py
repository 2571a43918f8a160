"""A loan is safe by construction, not by timing (kvtransfer/lend.py): the borrower uses what it
read only once the holder confirmed that the loan was still live when the read's release
arrived. Two engines, each with its own NIXL agent in its own process (lend_node.py).

- The holder's lease ends early (its clock jumps ahead: a paused or skewed holder) and it
  reuses the lent blocks for other prompts before the borrower reads them; the borrower's
  read completes well inside its own deadline, so only the holder can tell that what it read
  is no longer the prefix. It answers stale; the borrower computes, token-exact.
- With checksums on (`kv_transport.verify`), a lent block overwritten while the loan stays
  live (a bug) is caught as checksum_mismatch and computed, token-exact; clean loans read.
- A completed read whose confirm never comes is dropped at the deadline without a
  quarantine (nothing can land in its blocks any more).
"""

from __future__ import annotations

import random
import time

import pytest
from test_lending import call, connected, node, prompts, reference, settled_pool  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)
LONG_LEASE_MS = 60_000  # the borrower's deadline (half of it) is far away: timing cannot save it


def await_held(conn, what: str, timeout_s: float = 20.0) -> None:
    """Until the node holds back one message of ``what`` (grants, releases)."""
    deadline = time.monotonic() + timeout_s
    while call(conn, "held")[what] < 1:
        assert time.monotonic() < deadline, f"no {what[:-1]} arrived in {timeout_s} s"
        time.sleep(0.01)


def test_a_lent_block_the_holder_reused_before_the_read_is_not_used_the_prefix_is_computed(spawn_ctx, llama_dir,
                                                                                           reference):
    shared, prompt = prompts(21)
    rng = random.Random(210)
    with node(spawn_ctx, llama_dir, "holder") as (holder, _), \
            node(spawn_ctx, llama_dir, "reader", lease_ms=LONG_LEASE_MS) as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=shared + [7, 7])  # the holder caches the 10 shared blocks
        call(reader, "hold", what="grants")  # the reader reads only once the holder reused them
        lend_id = call(reader, "borrow_start", prompt=prompt, holder=holder_name, blocks=10)["lend_id"]
        assert lend_id is not None
        await_held(reader, "grants")
        [lent] = call(holder, "loans")["block_ids"]
        assert len(lent) == 10
        granted = call(holder, "digests", ids=lent)["digests"]
        # The holder's clock jumps past the lease it granted (the borrower's, 60 s): it ends the
        # loan and unpins, while the borrower, on its own clock, is far inside its deadline.
        assert call(holder, "skew", seconds=LONG_LEASE_MS / 1e3 + 1)["lent"] == 0
        # ...and reuses the blocks: other prompts through its 64-block pool overwrite them.
        for _ in range(16):
            now = call(holder, "digests", ids=lent)["digests"]
            if all(a != b for a, b in zip(granted, now)):
                break
            call(holder, "generate", prompt=[rng.randrange(5, 500) for _ in range(200)])
        else:
            raise AssertionError("the holder did not reuse every lent block")
        assert call(holder, "holds", prompt=prompt)["pool"] == 0  # (the prefix is gone from its cache)
        got = call(reader, "borrow_finish", lend_id=lend_id, prompt=prompt)
        # The read itself completed (before the reader's deadline): only the holder's answer
        # keeps the reused blocks out of the reader's cache.
        assert (got["outcome"], got["cached"], got["tokens"] == reference(prompt)) == ("stale", 0, True), got
        assert got["read_tokens"] == 0 and got["quarantined"] == 0, got  # a read that is over: freed at once
        assert got["borrower"] == {"asked": 1, "stale": 1}, got
        counters = call(holder, "pool")["lender"]
        assert counters == {"granted": 1, "expired": 1, "stale": 1}, counters
        for side in (holder, reader):
            pool = settled_pool(side)
            assert pool["free"] == pool["blocks"] and pool["lent"] == 0 and pool["quarantined"] == 0, pool


def test_with_checksums_a_lent_block_overwritten_while_the_loan_is_live_is_caught_and_computed(spawn_ctx, llama_dir,
                                                                                             reference):
    clean_shared, clean = prompts(22)
    shared, prompt = prompts(23)
    with node(spawn_ctx, llama_dir, "holder") as (holder, _), \
            node(spawn_ctx, llama_dir, "reader", lease_ms=LONG_LEASE_MS, verify=True) as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=clean_shared + [7, 7])
        call(holder, "generate", prompt=shared + [7, 7])
        # A clean verified loan: the checksums agree across the two processes; read, token-exact.
        got = call(reader, "borrow_generate", prompt=clean, holder=holder_name, blocks=10)
        assert (got["outcome"], got["cached"], got["tokens"] == reference(clean)) == ("read", 160, True), got
        # Now a bug writes into a lent block between the grant and the read, the loan still live:
        # the holder confirms it (its blocks stayed pinned), the checksums do not.
        call(reader, "hold", what="grants")
        lend_id = call(reader, "borrow_start", prompt=prompt, holder=holder_name, blocks=10)["lend_id"]
        await_held(reader, "grants")
        [lent] = call(holder, "loans")["block_ids"]
        call(holder, "scribble", ids=[lent[6]])
        got = call(reader, "borrow_finish", lend_id=lend_id, prompt=prompt)
        assert (got["outcome"], got["cached"], got["tokens"] == reference(prompt)) == \
            ("checksum_mismatch", 0, True), got
        assert "[6]" in got["detail"] and got["quarantined"] == 0, got
        assert got["borrower"] == {"asked": 2, "confirmed": 2, "read": 1, "checksum_mismatch": 1}, got
        counters = call(holder, "pool")["lender"]
        assert counters == {"granted": 2, "released": 2, "confirmed": 2}, counters
        for side in (holder, reader):
            pool = settled_pool(side)
            assert pool["free"] == pool["blocks"] and pool["lent"] == 0, pool


def test_a_completed_read_without_a_confirm_is_dropped_at_the_deadline_without_a_quarantine(spawn_ctx, llama_dir,
                                                                                           reference):
    shared, prompt = prompts(24)
    with node(spawn_ctx, llama_dir, "holder") as (holder, _), \
            node(spawn_ctx, llama_dir, "reader", quarantine_s=60.0, lease_ms=2000) as (reader, _):
        holder_name, _ = connected(holder, reader)
        call(holder, "generate", prompt=shared + [7, 7])
        call(holder, "hold", what="releases")  # the holder never answers (as if its confirm were lost)
        got = call(reader, "borrow_generate", prompt=prompt, holder=holder_name, blocks=10)
        assert (got["outcome"], got["detail"]) == ("timed_out", "no confirm from the holder"), got
        assert got["cached"] == 0 and got["tokens"] == reference(prompt)
        # The read was over: its blocks are free now, not after the 60 s quarantine.
        assert got["quarantined"] == 0, got
        assert call(holder, "held")["releases"] == 1
        pool = settled_pool(reader)
        assert pool["free"] == pool["blocks"] and pool["quarantined"] == 0, pool
        pool = settled_pool(holder)  # its lease ends the loan it never heard the end of
        assert pool["free"] == pool["blocks"] and pool["lent"] == 0, pool


def test_kv_transport_verify_reaches_the_workers_config_off_by_default(tmp_path):
    """network.kv_transport.verify is a topology setting: the worker's config carries it (decode
    workers hand it to their `Lending`), and it is no UCX setting."""
    from pdserve.cluster.topology import load_topology
    from pdserve.cluster.worker_config import WorkerConfig, launch_config

    def config(network: str) -> WorkerConfig:
        path = tmp_path / "topo.yaml"
        path.write_text("cluster: test\nmodel:\n  path: auto\nroles:\n  prefill: {replicas: 1}\n"
                        "  decode: {replicas: 1}\n" + network)
        cfg = launch_config(load_topology(path), "decode", 0, model="m", etcd_endpoints=["x:1"])
        return WorkerConfig.of({k: v for k, v in cfg.items() if k in WorkerConfig.__dataclass_fields__})

    assert not config("").lend_verify
    on = config("network:\n  kv_transport: {verify: true}\n")
    assert on.lend_verify and on.agent_ucx_env("127.0.0.1") == config("").agent_ucx_env("127.0.0.1")
