"""The KV handoff between TP sizes: bytes, time and bytes/s per (prefill TP, decode TP) pair.

Each rank is its own process with its own NIXL agent over its own HND pool holding its KV
heads (as in a TP worker); a request's pages move by the write plan of
handoff/head_plan.py: every prefill rank writes its head ranges into the decode ranks that
own them, all senders at once. Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128,
16-token blocks, float16: 2 MiB per block across layers), requests of ``--blocks`` blocks
scattered over the decode pools. Time is from the go signal to the last sender's last
write complete (NIXL's remote completion), median over ``--reps``; bytes/s is the
request's KV bytes over that time. A homogeneous pair writes whole blocks (one descriptor
per layer and run), a heterogeneous one a head range of each block (two per block and
layer): the issue's bar is >= 80% of the homogeneous bytes/s.

    python bench/tp_handoff.py                         # pairs 1-1 2-1 1-2 2-2, 64 blocks
    python bench/tp_handoff.py --pairs 1-1,2-1 --blocks 256 --reps 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import numpy as np

HEADS, LAYERS, HEAD_DIM, BLOCK = 8, 32, 128, 16
UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}


def layout_for(tp: int, rank: int, num_blocks: int):
    from pdserve.common.heads import kv_head_range
    from pdserve.kvtransfer import KVLayout

    return KVLayout("llama-3-8b", "float16", num_layers=LAYERS, num_blocks=num_blocks, block_size=BLOCK,
                    num_kv_heads=len(kv_head_range(HEADS, tp, rank)), head_dim=HEAD_DIM, kv_layout="HND",
                    total_kv_heads=HEADS, tp_size=tp, tp_rank=rank)


def rank_main(conn, name: str, tp: int, rank: int, num_blocks: int) -> None:
    """A rank: an agent over its pool; obeys the parent (add peers, write a plan, poll)."""
    os.environ.update(UCX)
    import torch

    from pdserve.kvtransfer import KVTransferAgent

    layout = layout_for(tp, rank, num_blocks)
    kv = torch.zeros(layout.shape, dtype=torch.float16)
    agent = KVTransferAgent(name, kv, layout, ucx_env=UCX)
    conn.send(agent.local_info())
    while True:
        while not conn.poll(0.001):
            agent.poll()  # a target must keep polling, or NIXL's wire-up stalls
        cmd = conn.recv()
        if cmd["op"] == "exit":
            agent.close()
            conn.send("bye")
            return
        if cmd["op"] == "add":
            for info in cmd["infos"]:
                agent.add_peer(info)
            conn.send("ok")
        elif cmd["op"] == "write":
            t0 = time.perf_counter()
            handles = [agent.write_blocks(peer, cmd["local"], cmd["remote"], heads=tuple(heads))
                       for peer, heads in cmd["writes"]]
            for h in handles:
                agent.wait(h, 60.0)
            conn.send({"s": time.perf_counter() - t0, "bytes": sum(h.num_bytes for h in handles),
                       "descriptors": sum(h.num_descriptors for h in handles)})


def run_pair(ctx, p_tp: int, d_tp: int, args) -> dict:
    from pdserve.handoff.head_plan import write_plan

    procs = []

    def spawn(name, tp, rank, blocks):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=rank_main, args=(child, name, tp, rank, blocks), daemon=True)
        proc.start()
        procs.append((proc, parent))
        return parent

    senders = [spawn(f"p{r}", p_tp, r, args.blocks) for r in range(p_tp)]
    receivers = [spawn(f"d{r}", d_tp, r, args.pool_blocks) for r in range(d_tp)]
    try:
        infos = [c.recv() for c in receivers]
        for c in senders:
            c.recv()
            c.send({"op": "add", "infos": infos})
            assert c.recv() == "ok"
        plan = write_plan(HEADS, p_tp, d_tp)
        rng = np.random.default_rng(args.seed)
        times, moved, descs = [], 0, 0
        for rep in range(args.reps + 1):
            local = list(range(args.blocks))
            remote = sorted(rng.choice(args.pool_blocks, args.blocks, replace=False).tolist())
            for s, c in enumerate(senders):
                c.send({"op": "write", "local": local, "remote": remote,
                        "writes": [[f"d{w.dst_rank}", [w.src_head, w.dst_head, w.num_heads]]
                                   for w in plan.writes_from(s)]})
            replies = [c.recv() for c in senders]
            if rep:  # the first one wires connections up
                times.append(max(r["s"] for r in replies))
                moved, descs = sum(r["bytes"] for r in replies), sum(r["descriptors"] for r in replies)
        return {"pair": f"{p_tp}-{d_tp}", "bytes": moved, "descriptors": descs, "ms": statistics.median(times) * 1e3,
                "min_ms": min(times) * 1e3}
    finally:
        for proc, conn in procs:
            try:
                conn.send({"op": "exit"})
                conn.recv()
            except (OSError, EOFError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="1-1,2-1,1-2,2-2", help="prefill TP - decode TP pairs")
    p.add_argument("--blocks", type=int, default=64, help="blocks per request (16 tokens each)")
    p.add_argument("--pool-blocks", type=int, default=160, help="blocks of each decode pool (targets scatter)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for pair in args.pairs.split(","):
        p_tp, d_tp = (int(x) for x in pair.split("-"))
        print(f"[{pair}] {p_tp + d_tp} processes ...", flush=True)
        rows.append(run_pair(ctx, p_tp, d_tp, args))
    base = next((r for r in rows if r["pair"] == "1-1"), None)
    print(f"\nLlama-3-8B KV (fp16, HND), {args.blocks} blocks = {args.blocks * BLOCK} tokens per request, "
          f"median of {args.reps}")
    print("| prefill TP - decode TP | bytes | descriptors | ms (min) | GB/s | vs 1-1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        gbs = r["bytes"] / r["ms"] / 1e6
        rel = f"{gbs / (base['bytes'] / base['ms'] / 1e6):.2f}x" if base else "-"
        print(f"| {r['pair']} | {r['bytes']:,} | {r['descriptors']:,} | {r['ms']:.1f} ({r['min_ms']:.1f}) | "
              f"{gbs:.2f} | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
