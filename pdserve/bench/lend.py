"""A prefix lent by another worker against computing it, at each pair of TP sizes.

Two real engines in this process (their other TP ranks as child processes), each with a NIXL
agent per rank over loopback UCX, and each worker's `Lending` (kvtransfer/lending.py) driven
as the workers' loops drive it. For every (holder TP, borrower TP) pair and every repeat, with
a fresh random prefix each time:

- ``computed``: the borrower prefills prefix + question itself (nothing cached);
- ``borrowed``: the holder has the prefix cached; the borrower borrows it (request, grant,
  each rank reading its heads from the holder ranks that hold them, release), then prefills
  only the question. Its time counts from the borrow's start.

Prints per pair the read's time, TTFT (first token) of both ways and their ratio, p50 over the
repeats; pools of different TP sizes read head ranges (HND on both).

    python bench/lend.py                                  # the default ~34M model under .cache/
    python bench/lend.py --prefix-len 2048 --repeats 7 --pairs 1-1,2-2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: make the default ~34M model under .cache/)")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of the lent prefix (whole blocks are lent)")
    p.add_argument("--question-len", type=int, default=32, help="new tokens after the prefix")
    p.add_argument("--repeats", type=int, default=5, help="prompts per pair and way (a fresh prefix each)")
    p.add_argument("--pairs", default="1-1,2-2,2-1,1-2", help="holder TP-borrower TP pairs, comma-separated")
    p.add_argument("--timeout-s", type=float, default=30.0, help="give up on one borrow after this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.pairs = [tuple(int(x) for x in pair.split("-")) for pair in args.pairs.split(",")]
    except ValueError:
        p.error(f"--pairs: expected e.g. 1-1,2-1 (holder TP-borrower TP), got {args.pairs!r}")
    if any(len(pair) != 2 or min(pair) < 1 for pair in args.pairs):
        p.error(f"--pairs: each pair is two TP sizes >= 1, got {args.pairs!r}")
    return args


def default_model() -> str:
    from engine_throughput import default_model as made

    return made()


@contextlib.contextmanager
def lending_worker(model: str, worker_id: str, tp: int, num_blocks: int):
    """An engine, its transport on every rank (as a worker opens it), and its `Lending`."""
    from pdserve.engine import LLMEngine
    from pdserve.engine.config import EngineConfig
    from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV
    from pdserve.kvtransfer.lending import Lending
    from pdserve.kvtransfer.nixl.tp_transport import open_worker_transport, with_rank_transport

    eng = LLMEngine(EngineConfig.from_kwargs(model, **with_rank_transport(
        {"tensor_parallel_size": tp, "kv_layout": "HND", "num_gpu_blocks_override": num_blocks, "device": "cpu"})))
    transport = None
    try:
        transport = open_worker_transport(worker_id, eng, LOOPBACK_UCX_ENV)
        sender = transport.sender()
        yield eng, sender, transport.record, Lending(eng.connector, sender)
    finally:
        if transport is not None:
            transport.agent.close()
        eng.close()


def first_token_ms(eng, prompt: list[int], rid: str) -> float:
    from pdserve.engine import SamplingParams

    t0 = time.perf_counter()
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id=rid)
    while eng.has_work():
        eng.step()
    eng.release(rid)
    return (time.perf_counter() - t0) * 1e3


def run_pair(model: str, holder_tp: int, borrower_tp: int, args, rng: random.Random) -> dict:
    bs = 16
    blocks = args.prefix_len // bs
    num_blocks = 4 * (blocks + args.question_len // bs + 2)
    name = f"{holder_tp}{borrower_tp}"
    with lending_worker(model, f"holder{name}", holder_tp, num_blocks) as (he, hs, h_record, h_lend), \
            lending_worker(model, f"borrower{name}", borrower_tp, num_blocks) as (be, bsend, b_record, b_lend):
        holder = bsend.add_peer(h_record)
        hs.add_peer(b_record)

        def prompt():
            return [rng.randrange(3, 32000) for _ in range(args.prefix_len + args.question_len)]

        first_token_ms(be, prompt(), "warm-b")  # first-step costs out of the figures
        read_ms, borrowed_ms, computed_ms, outcomes = [], [], [], []
        for r in range(args.repeats):
            computed_ms.append(first_token_ms(be, prompt(), f"c{r}"))
            p = prompt()
            first_token_ms(he, p[:args.prefix_len] + [7], f"h{r}")  # the holder caches the prefix
            t0 = time.perf_counter()
            lend_id = b_lend.borrower.start(p, holder, blocks)
            result = None
            deadline = time.monotonic() + args.timeout_s
            while lend_id is not None and result is None and time.monotonic() < deadline:
                h_lend.on_poll(hs.poll())
                b_lend.on_poll(bsend.poll())
                result = next(iter(b_lend.borrower.take_results()), None)
            read_ms.append((time.perf_counter() - t0) * 1e3)
            outcomes.append(result.outcome if result is not None else "not started" if lend_id is None else "none")
            borrowed_ms.append(read_ms[-1] + first_token_ms(be, p, f"b{r}"))
        for _ in range(200):  # the release reaches the holder
            h_lend.on_poll(hs.poll())
            if not h_lend.lender.table.loans:
                break
            time.sleep(0.005)
        return {"holder_tp": holder_tp, "borrower_tp": borrower_tp, "outcomes": outcomes,
                "read_ms": statistics.median(read_ms), "borrowed_ms": statistics.median(borrowed_ms),
                "computed_ms": statistics.median(computed_ms), "lender": dict(h_lend.lender.counters),
                "still_lent": h_lend.lender.table.lent_blocks}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_model()
    rng = random.Random(args.seed)
    rows = []
    for holder_tp, borrower_tp in args.pairs:
        print(f"holder TP={holder_tp}, borrower TP={borrower_tp}: {args.repeats} x {args.prefix_len}-token prefix ...",
              flush=True)
        rows.append(run_pair(model, holder_tp, borrower_tp, args, rng))
    print(f"\n## A lent {args.prefix_len}-token prefix against computing it ({args.question_len}-token question, "
          f"p50 of {args.repeats})\n")
    print("| holder TP | borrower TP | outcomes | read ms | TTFT borrowed ms | TTFT computed ms | computed/borrowed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        seen = {o: r["outcomes"].count(o) for o in dict.fromkeys(r["outcomes"])}
        print(f"| {r['holder_tp']} | {r['borrower_tp']} | {seen} | {r['read_ms']:.1f} | {r['borrowed_ms']:.1f} | "
              f"{r['computed_ms']:.1f} | {r['computed_ms'] / r['borrowed_ms']:.2f}x |")
    bad = [r for r in rows if set(r["outcomes"]) != {"read"} or r["still_lent"]]
    for r in bad:
        print(f"holder TP={r['holder_tp']} borrower TP={r['borrower_tp']}: not every borrow was read "
              f"({r['outcomes']}), or blocks stay lent ({r['still_lent']}); lender {r['lender']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
