"""The second KV tier on a GPU worker: load bandwidth from host memory against the PCIe floor.

One run, one device, Llama-3-8B KV geometry by default (32 layers, 8 KV heads, head_dim 128,
16-token blocks, bfloat16: 2 MiB a block). The engine's own `KVTier` (pinned host slots, its
copy thread and CUDA stream) stores ``--blocks`` blocks offered from a device pool, then
loads runs of them back into other pool blocks; every load is checked byte for byte against
the blocks it came from. Side by side, on the same bytes:

- **floor**: one contiguous pinned host -> device copy (`cudaMemcpyAsync`, what the link
  gives at best), and device -> host for the offload direction;
- **pageable**: the same copy from ordinary (pageable) host memory;
- **gather**: the tier's load before session 22 (index the slots on the host, copy the
  pageable result, scatter on the device), for the record;
- **tier**: `KVTier` itself, timed from `start_load` to the load's completion as the
  engine sees it (the copy thread's own clock, `TierLoad.seconds`).

Reports GB/s (1e9 bytes/s) and each as a share of the floor, per load size; the link's
nominal rate (PCIe generation x width, from NVML) when NVML answers.

    python bench/kv_tier_gpu.py                        # on a GPU machine
    python bench/kv_tier_gpu.py --device cpu --layers 2 --blocks 16 --sizes 1,4 --reps 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the script)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--blocks", type=int, default=512, help="blocks stored in the tier (and the pool's size)")
    p.add_argument("--sizes", default="1,8,64,256", help="blocks per load")
    p.add_argument("--reps", type=int, default=5, help="timed loads per size (median kept)")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def nominal_pcie_gb_per_s() -> tuple[float | None, str]:
    """The link's nominal per-direction rate from NVML: (GB/s, description) or (None, why not)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        gen, width = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
        max_gen, max_width = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
    except Exception as exc:  # noqa: BLE001  (NVML absent or refused: the measured floor still stands)
        return None, f"NVML gave no link ({exc.__class__.__name__}: {exc})"
    gt_per_s = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}.get(gen)
    if gt_per_s is None:
        return None, f"PCIe gen {gen} x{width}: rate unknown"
    coding = 0.8 if gen <= 2 else 128 / 130
    rate = gt_per_s * width * coding / 8
    return rate, f"PCIe gen {gen} x{width} (max gen {max_gen} x{max_width}): {rate:.1f} GB/s per direction nominal"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from pdserve.engine.block_manager import BlockPool
    from pdserve.engine.kv_tier import KVTier

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("kv_tier_gpu: no CUDA device here; --device cpu runs the script as a smoke test")
        return 2
    dtype = getattr(torch, args.dtype)
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) * 2 > args.blocks:
        raise SystemExit(f"--blocks {args.blocks} must be at least twice the largest --sizes ({max(sizes)}): "
                         "a load writes into blocks other than its sources")
    shape = (args.layers, args.blocks, 2, args.block_size, args.kv_heads, args.head_dim)
    pool_t = torch.randn(shape, dtype=torch.float32, device=dev).to(dtype)
    original = pool_t.clone()
    block_bytes = pool_t[:, 0].numel() * pool_t.element_size()
    print(f"kv_tier_gpu: {torch.cuda.get_device_name(dev) if cuda else 'cpu'}; {args.blocks} blocks of "
          f"{block_bytes / 2**20:.2f} MiB ({args.layers} layers, {args.kv_heads} KV heads, head_dim "
          f"{args.head_dim}, {args.block_size}-token blocks, {args.dtype})", flush=True)
    nominal, link = nominal_pcie_gb_per_s() if cuda else (None, "cpu run: no link")
    print(f"kv_tier_gpu: {link}", flush=True)

    pool = BlockPool(args.blocks)
    tier = KVTier(pool_t, args.blocks * block_bytes, "auto", None, None, window=args.blocks)
    hashes = []
    for i in range(args.blocks):
        [blk] = pool.allocate(1)
        h = i.to_bytes(4, "big") * 8
        pool.cache(blk, h, None, tuple(range(args.block_size)))
        pool.release([blk])
        hashes.append((h, blk.block_id))
    t0 = time.perf_counter()
    offered = tier.offer_lru_head(pool)
    deadline = time.monotonic() + 300
    while tier.snapshot()["in_flight"]:
        if time.monotonic() > deadline:
            raise SystemExit("kv_tier_gpu: the tier's copy thread did not store the blocks in 300 s")
        time.sleep(0.001)
    offload_s = time.perf_counter() - t0
    snap = tier.snapshot()
    if snap["stored"] != args.blocks:
        raise SystemExit(f"kv_tier_gpu: {snap['stored']} of {offered} offered blocks stored ({snap})")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    rows = []
    slots_view = tier.store.view()
    for n in sizes:
        nbytes = n * block_bytes
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        on_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        floor = statistics.median(timed(lambda: on_dev.copy_(pinned, non_blocking=True)) for _ in range(args.reps))
        floor_d2h = statistics.median(timed(lambda: pinned.copy_(on_dev, non_blocking=True))
                                      for _ in range(args.reps))
        page = statistics.median(timed(lambda: on_dev.copy_(pageable)) for _ in range(args.reps))
        tier_s, gather_s = [], []
        for rep in range(args.reps):
            start = (rep * n) % (args.blocks - n + 1)
            chosen = hashes[start:start + n]
            targets = pool.allocate(n)  # other blocks of the pool (the sources' prefixes leave the pool)
            src_ids = [bid for _, bid in chosen]
            if rep == 0:  # the pre-session-22 path, on the same slots and targets
                slot_ids = [tier._slots[h] for h, _ in chosen]
                ids = torch.tensor([b.block_id for b in targets], dtype=torch.long, device=dev)

                def gather():
                    src = slots_view[torch.tensor(slot_ids, dtype=torch.long)].transpose(0, 1)
                    pool_t.index_copy_(1, ids, src.to(dev, non_blocking=True))
                gather_s += [timed(gather) for _ in range(args.reps)]
            pool_t[:, [b.block_id for b in targets]] = 0
            sync()
            load = tier.start_load(f"bench-{n}-{rep}", [h for h, _ in chosen], targets, targets)
            if load is None or len(load.blocks) != n:
                raise SystemExit(f"kv_tier_gpu: the tier no longer holds the {n} blocks asked for")
            t_end = time.monotonic() + 60
            done = []
            while not done:
                if time.monotonic() > t_end:
                    raise SystemExit("kv_tier_gpu: a load did not finish in 60 s")
                tier.wait_for_load(0.01)
                done = [d for d in tier.finished_loads() if d is load]
            if load.error:
                raise SystemExit(f"kv_tier_gpu: the load failed: {load.error}")
            got = pool_t[:, [b.block_id for b in targets]]
            want = original[:, src_ids]
            if not torch.equal(got, want):
                raise SystemExit(f"kv_tier_gpu: a load of {n} blocks wrote other bytes than the blocks it came from")
            tier_s.append(load.seconds)
            pool.release(targets)
        gbs = lambda s: nbytes / s / 1e9  # noqa: E731
        row = {"blocks": n, "bytes": nbytes, "floor_h2d_gb_s": gbs(floor), "floor_d2h_gb_s": gbs(floor_d2h),
               "pageable_gb_s": gbs(page), "gather_gb_s": gbs(statistics.median(gather_s)),
               "tier_gb_s": gbs(statistics.median(tier_s)), "tier_ms": statistics.median(tier_s) * 1e3}
        row["tier_of_floor"] = row["tier_gb_s"] / row["floor_h2d_gb_s"]
        row["gather_of_floor"] = row["gather_gb_s"] / row["floor_h2d_gb_s"]
        rows.append(row)
        print(f"kv_tier_gpu: {n} blocks checked: tier {row['tier_gb_s']:.1f} GB/s, floor {row['floor_h2d_gb_s']:.1f}",
              flush=True)
    offload_gb_s = args.blocks * block_bytes / offload_s / 1e9
    tier.close()

    print()
    print("| blocks | MiB | floor H2D GB/s | tier GB/s | tier / floor | gather GB/s | gather / floor "
          "| pageable GB/s | floor D2H GB/s | tier load ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['blocks']} | {r['bytes'] / 2**20:.0f} | {r['floor_h2d_gb_s']:.1f} | {r['tier_gb_s']:.1f} | "
              f"{r['tier_of_floor']:.2f}x | {r['gather_gb_s']:.1f} | {r['gather_of_floor']:.2f}x | "
              f"{r['pageable_gb_s']:.1f} | {r['floor_d2h_gb_s']:.1f} | {r['tier_ms']:.2f} |")
    print(f"\noffload: {args.blocks} blocks offered at once, stored by the copy thread in {offload_s * 1e3:.0f} ms "
          f"({offload_gb_s:.1f} GB/s, one copy per block)")
    if nominal:
        print(f"nominal link: {nominal:.1f} GB/s per direction; best tier load {max(r['tier_gb_s'] for r in rows):.1f} "
              f"GB/s = {max(r['tier_gb_s'] for r in rows) / nominal:.2f}x of it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "block_bytes": block_bytes, "link": link, "nominal_gb_s": nominal,
                       "offload_gb_s": offload_gb_s, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
