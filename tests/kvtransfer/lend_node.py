"""A worker-like child for the lending tests: an engine, its NIXL agent, a `Lender` and a
`Borrower` (kvtransfer/lender.py, kvtransfer/borrower.py), driven over a pipe. Between
commands it keeps polling its agent and answering loans, as a worker's engine loop does.

For the loans' safety tests it can also hold back the grants it receives (its borrower reads
only once the test says so), hold back the releases it receives (its lender answers none),
run its lender on a clock the test moves forward (a paused or skewed holder), and show or
overwrite the bytes of blocks in its pool."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

from kvt_peer import LOOPBACK_UCX_ENV

IDLE_POLL_S = 0.002


def lend_node_main(conn: Any, model: str, name: str, num_blocks: int, quarantine_s: float, lease_ms: int,
                   engine_args: dict | None = None, verify: bool = False) -> None:
    os.environ.update(LOOPBACK_UCX_ENV)
    import torch

    from pdserve.engine import LLM, SamplingParams
    from pdserve.kvtransfer.lend import LendGrant, LendRelease
    from pdserve.kvtransfer.nixl.agent import KVTransferAgent
    from pdserve.kvtransfer.nixl.layout import KVLayout
    from pdserve.kvtransfer.borrower import Borrower
    from pdserve.kvtransfer.lender import Lender
    from pdserve.kvtransfer.lending import route_notification

    llm = LLM(model, num_gpu_blocks_override=num_blocks, device="cpu", **(engine_args or {}))
    eng = llm.engine
    conn_ = eng.connector
    m = eng.model_config
    layout = KVLayout.from_tensor(conn_.kv_tensor, m.model_id, kv_layout=conn_.kv_layout, total_kv_heads=m.num_kv_heads)
    agent = KVTransferAgent(name, conn_.kv_tensor, layout, ucx_env=LOOPBACK_UCX_ENV)
    skew = [0.0]  # seconds the lender's clock runs ahead of the real one
    lender = Lender(conn_, agent, clock=lambda: time.monotonic() + skew[0])
    borrower = Borrower(conn_, agent, lease_ms=lease_ms, quarantine_s=quarantine_s,
                        **({"verify": True} if verify else {}))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    die_after_grant = False
    hold = {"grants": False, "releases": False}
    held: dict[str, list] = {"grants": [], "releases": []}

    def drive() -> None:
        res = agent.poll()
        for note in res.notifications:
            msg = route_notification(note.payload)
            if msg is None:
                continue
            if hold["grants"] and isinstance(msg, LendGrant) or hold["releases"] and isinstance(msg, LendRelease):
                held["grants" if isinstance(msg, LendGrant) else "releases"].append((note.sender, msg))
                continue
            lender.handle(note.sender, msg)
            borrower.handle(note.sender, msg)
            if die_after_grant and lender.counters["granted"]:
                os.kill(os.getpid(), signal.SIGKILL)  # dead with the loan out, the read about to start
        borrower.transfers(res.completed, res.failed)
        lender.expire()
        borrower.expire()

    def generate(prompt):
        out = llm.generate([prompt], greedy)[0]
        return {"tokens": out.token_ids, "cached": out.num_cached_tokens}

    def finish_borrow(lend_id, prompt):
        result = None
        deadline = time.monotonic() + 30
        while lend_id is not None and result is None and time.monotonic() < deadline:
            drive()
            result = next((r for r in borrower.take_results() if r.lend_id == lend_id), None)
            time.sleep(0.0005)
        out = generate(prompt)
        return {**out, "started": lend_id is not None,
                "outcome": result.outcome if result else None, "detail": result.detail if result else "",
                "read_tokens": result.read_tokens if result else 0,
                "quarantined": len(borrower.quarantined), "borrower": dict(borrower.counters)}

    def digests(ids):
        """Each block's bytes in this pool, hashed here (not by the code under test)."""
        kv = conn_.kv_tensor
        return [hashlib.blake2b(kv[:, b].contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                                digest_size=8).hexdigest() for b in ids]

    try:
        while True:
            while not conn.poll(IDLE_POLL_S):
                drive()
            cmd = conn.recv()
            op = cmd.pop("op")
            if op == "exit":
                conn.send({"ok": True})
                return
            if op == "info":
                conn.send({"info": agent.local_info()})
            elif op == "add_peer":
                conn.send({"name": agent.add_peer(cmd["info"])})
            elif op == "generate":
                conn.send(generate(cmd["prompt"]))
            elif op == "die_after_grant":
                die_after_grant = True
                conn.send({"ok": True})
            elif op == "borrow_generate":
                lend_id = borrower.start(cmd["prompt"], cmd["holder"], cmd["blocks"])
                conn.send(finish_borrow(lend_id, cmd["prompt"]))
            elif op == "borrow_start":  # (the test goes on meanwhile; this node keeps driving the loan)
                conn.send({"lend_id": borrower.start(cmd["prompt"], cmd["holder"], cmd["blocks"])})
            elif op == "borrow_finish":  # (what it held back first: the grants it received)
                hold["grants"] = False
                for sender, msg in held["grants"]:
                    borrower.handle(sender, msg)
                held["grants"].clear()
                conn.send(finish_borrow(cmd["lend_id"], cmd["prompt"]))
            elif op == "hold":  # hold back the grants or the releases this node receives
                hold[cmd["what"]] = True
                conn.send({"ok": True})
            elif op == "held":
                conn.send({what: len(msgs) for what, msgs in held.items()})
            elif op == "skew":  # the lender's clock jumps ahead (a paused holder, a skewed timer)
                skew[0] += cmd["seconds"]
                drive()
                conn.send({"lent": lender.table.lent_blocks})
            elif op == "loans":
                conn.send({"block_ids": [list(loan.block_ids) for loan in lender.table.loans.values()]})
            elif op == "digests":
                conn.send({"digests": digests(cmd["ids"])})
            elif op == "scribble":  # a bug writes into lent blocks while the loan is live
                g = torch.Generator().manual_seed(cmd.get("seed", 0))
                for b in cmd["ids"]:
                    view = conn_.kv_tensor[:, b]
                    view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
                conn.send({"ok": True})
            elif op == "holds":  # the prompt's tokens in the pool, and right after them in the tier
                pooled = conn_.cached_prefix_len(cmd["prompt"])
                conn.send({"pool": pooled, "tier": conn_.tier_prefix_len(cmd["prompt"], pooled)})
            elif op == "pool":
                drive()
                conn.send({"free": eng.kv.pool.num_free, "blocks": eng.kv.pool.num_blocks,
                           "lent": lender.table.lent_blocks, "quarantined": len(borrower.quarantined),
                           "lender": dict(lender.counters), "borrower": dict(borrower.counters)})
    finally:
        agent.close()
        llm.close()
