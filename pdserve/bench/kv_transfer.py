"""KV page transfer microbenchmark: NIXL page writes between two processes.

Measures, for a Llama-3-8B-shaped KV pool (32 layers, 8 KV heads, head_dim
128, block 16 tokens: 2 MiB per block across layers), requests of 1 block, 64
blocks and 4096 tokens (256 blocks):

  coalesced       write_blocks, runs of consecutive ids -> one descriptor per (layer, run)
  fragmented      same, remote blocks scattered in runs of 1-16 (a busy decode pool)
  per-block       write_blocks(coalesce=False): one descriptor per (layer, block)
  (a) raw NIXL    one contiguous descriptor of the same byte count (write_bytes)
  (b) torch copy  in-process copy of the same bytes (Tensor.copy_)

This process is the sender; a spawned child owns the receiving pool and polls
its agent like a decode worker's step loop. Latency is from the write call to
completion seen by the sender (the NIXL flush makes that remote completion).

    python bench/kv_transfer.py [--device cpu|cuda] [--dtype float16] [--reps 1.0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV, KVLayout, KVTransferAgent, plan_block_write

SIZES_BLOCKS = (1, 64, 256)  # 256 blocks x 16 tokens = a 4096-token request
POOL_BLOCKS = 512  # per side: 1 GiB at fp16, room for scattered targets
BASE_REPS = {1: 300, 64: 30, 256: 10}
WAIT_TIMEOUT_S = 60.0
IDLE_POLL_INTERVAL_S = 0.001
RAW = "(a) raw NIXL 1 desc"
TORCH = "(b) torch copy"


def llama8b_layout(dtype: str, num_blocks: int) -> KVLayout:
    return KVLayout("llama-3-8b", dtype, num_layers=32, num_blocks=num_blocks, block_size=16,
                    num_kv_heads=8, head_dim=128)


def allocate_pool(layout: KVLayout, device: str, fill: int):
    import torch

    kv = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
    kv.view(-1).view(torch.uint8).fill_(fill)
    return kv


def receiver_main(conn, layout_record: dict, device: str) -> None:
    """Child: own the target pool, publish its record, poll until told to stop."""
    layout = KVLayout.from_dict(layout_record)
    kv = allocate_pool(layout, device, fill=0)
    with KVTransferAgent("bench-receiver", kv, layout) as agent:
        conn.send(agent.local_info())
        while not conn.poll(IDLE_POLL_INTERVAL_S):
            agent.poll()
        conn.recv()
    conn.send("closed")


def fragmented_targets(num_blocks: int, pool_blocks: int, rng: np.random.Generator) -> list[int]:
    """Remote block ids in runs of 1-16 placed in shuffled order across the pool."""
    lengths = []
    while sum(lengths) < num_blocks:
        lengths.append(min(int(rng.integers(1, 17)), num_blocks - sum(lengths)))
    slot = pool_blocks // len(lengths)  # each run gets its own slot, starting anywhere in it
    targets = []
    for run, slot_index in zip(lengths, rng.permutation(len(lengths))):
        start = slot_index * slot + int(rng.integers(0, slot - run + 1))
        targets += range(start, start + run)
    return targets


def time_interleaved(ops: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    """Time each op `reps` times, round-robin, so load changes on a shared box hit all cases alike."""
    for op in ops.values():  # warm-up: connection, registration caches, page faults
        op()
        op()
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            samples[name].append(time.perf_counter() - start)
    return samples


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    layout = llama8b_layout(args.dtype, POOL_BLOCKS)
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(child_conn, layout.to_dict(), args.device))
    receiver.start()
    kv = allocate_pool(layout, args.device, fill=7)
    agent = KVTransferAgent("bench-sender", kv, layout)
    try:
        if not parent_conn.poll(120):
            raise TimeoutError("the receiver process did not start within 120 s")
        peer = agent.add_peer(parent_conn.recv())
        rows = measure_all(agent, peer, kv, layout, args, torch)
    finally:
        agent.close()
        parent_conn.send("stop")
        if parent_conn.poll(60):
            parent_conn.recv()  # "closed"
        receiver.join(60)
    if receiver.exitcode != 0:
        raise SystemExit(f"receiver exited with code {receiver.exitcode}")
    return rows


def planning_us(layout: KVLayout, local: list[int], remote: list[int]) -> float:
    """Median CPU time of planning one request (Python + numpy), in microseconds."""
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        plan_block_write(layout, layout, local, remote)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def measure_all(agent, peer, kv, layout, args, torch) -> list[dict]:
    rng = np.random.default_rng(0)
    flat_src = kv.view(-1).view(torch.uint8)
    flat_dst = torch.empty_like(flat_src[: max(SIZES_BLOCKS) * layout.num_layers * layout.block_bytes])
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for num_blocks in args.sizes:
        reps = max(3, int(BASE_REPS.get(num_blocks, 10) * args.reps))
        num_bytes = num_blocks * layout.num_layers * layout.block_bytes
        local = list(range(num_blocks))
        contiguous = list(range(POOL_BLOCKS - num_blocks, POOL_BLOCKS))
        fragmented = fragmented_targets(num_blocks, POOL_BLOCKS, rng)

        def blocks(remote: list[int], coalesce: bool = True) -> Callable[[], None]:
            return lambda: agent.wait(
                agent.write_blocks(peer, local, remote, coalesce=coalesce), WAIT_TIMEOUT_S
            )

        def torch_copy() -> None:
            flat_dst[:num_bytes].copy_(flat_src[:num_bytes])
            sync()

        ops = {
            "coalesced": blocks(contiguous),
            "fragmented": blocks(fragmented),
            "per-block": blocks(contiguous, coalesce=False),
            RAW: lambda: agent.wait(agent.write_bytes(peer, 0, 0, num_bytes), WAIT_TIMEOUT_S),
            TORCH: torch_copy,
        }
        descriptors = {
            "coalesced": plan_block_write(layout, layout, local, contiguous).num_descriptors,
            "fragmented": plan_block_write(layout, layout, local, fragmented).num_descriptors,
            "per-block": num_blocks * layout.num_layers,
            RAW: 1,
            TORCH: None,
        }
        if num_blocks == 1:
            del ops["fragmented"]  # one block has no fragmentation
        samples = time_interleaved(ops, reps)
        agent.poll()  # forget finished handles
        rows += [summarize(num_blocks, name, num_bytes, descriptors[name], samples[name]) for name in ops]
        rows[-len(ops)]["plan_us_fragmented"] = planning_us(layout, local, fragmented)
    for row in rows:
        same_size = {r["case"]: r for r in rows if r["blocks"] == row["blocks"]}
        row["vs_a"] = row["gb_per_s"] / same_size[RAW]["gb_per_s"]
        row["vs_b"] = row["gb_per_s"] / same_size[TORCH]["gb_per_s"]
    return rows


def summarize(num_blocks: int, name: str, num_bytes: int, descriptors, samples: list[float]) -> dict:
    median = statistics.median(samples)
    return {
        "blocks": num_blocks,
        "case": name,
        "bytes": num_bytes,
        "descriptors": descriptors,
        "reps": len(samples),
        "median_ms": median * 1e3,
        "p90_ms": float(np.percentile(samples, 90)) * 1e3,
        "min_ms": min(samples) * 1e3,
        "gb_per_s": num_bytes / median / 1e9,
    }


def print_summary(rows: list[dict]) -> None:
    by_case = {(r["blocks"], r["case"]): r for r in rows}
    one, raw_one = by_case.get((1, "coalesced")), by_case.get((1, RAW))
    if one and raw_one:
        print(f"1-block request: {one['median_ms']:.3f} ms median (goal < 1 ms); overhead over a raw "
              f"1-descriptor write of the same bytes: {one['median_ms'] - raw_one['median_ms']:+.3f} ms")
    big = by_case.get((256, "coalesced"))
    if big:
        print(f"4096-token request: coalesced reaches {big['vs_a']:.0%} of the raw contiguous NIXL write "
              f"(goal >= 80%), {big['vs_b']:.0%} of an in-process torch copy")
    plans = ", ".join(f"{r['blocks']} blk {r['plan_us_fragmented']:.0f} us"
                      for r in rows if "plan_us_fragmented" in r)
    print(f"planning a request (block ids -> descriptors, fragmented targets): {plans}")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    layout = llama8b_layout(args.dtype, POOL_BLOCKS)
    per_block = layout.num_layers * layout.block_bytes
    ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    print(f"KV transfer bench: Llama-3-8B KV geometry, {args.dtype}, {per_block / 2**20:.2f} MiB per "
          f"block (all layers); {args.device} pool, two processes, UCX backend, progress thread off")
    print(f"env: {ucx or 'UCX defaults'}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("GB/s = 1e9 bytes/s from the median; vs(a), vs(b) = bandwidth ratio to the raw 1-descriptor "
          "NIXL write and to the in-process torch copy of the same bytes")
    header = f"{'request':<18}{'case':<22}{'MiB':>8}{'descs':>7}{'median ms':>11}{'p90 ms':>9}" \
             f"{'GB/s':>8}{'vs(a)':>7}{'vs(b)':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        request = f"{row['blocks']} blk/{row['blocks'] * 16} tok"
        descs = "-" if row["descriptors"] is None else str(row["descriptors"])
        print(f"{request:<18}{row['case']:<22}{row['bytes'] / 2**20:>8.1f}{descs:>7}"
              f"{row['median_ms']:>11.3f}{row['p90_ms']:>9.3f}{row['gb_per_s']:>8.2f}"
              f"{row['vs_a']:>7.2f}{row['vs_b']:>7.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both pools live: cpu (DRAM) or cuda (VRAM, both processes on GPU 0)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(SIZES_BLOCKS), help="request sizes in blocks, e.g. 1,64,256")
    parser.add_argument("--reps", type=float, default=1.0, help="scale the repetition counts")
    parser.add_argument("--no-loopback-env", action="store_true",
                        help=f"do not set {dict(LOOPBACK_UCX_ENV)} (e.g. to bench a real NIC)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if max(args.sizes) > POOL_BLOCKS // 2:
        parser.error(f"sizes must be <= {POOL_BLOCKS // 2} blocks")
    if not args.no_loopback_env:
        os.environ.update(LOOPBACK_UCX_ENV)  # before any agent; the child inherits it
    rows = run(args)
    print_table(rows, args)
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
