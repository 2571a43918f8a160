"""Speculative decoding across the hop: a draft model's (or EAGLE head's) prompt KV shipped by
the prefill side against computed by the decode side (``draft_prompt_kv`` prefill against
decode), and what each costs where (docs/speculative.md, "In the cluster").

One process holds a prefill engine and a decode engine, each with its NIXL agent over loopback
UCX, opened as workers open them (kvtransfer/nixl/tp_transport.py), both speculating with the
same draft model (the target's first ``--draft-layers`` layers, an early-exit draft), or with
``--method eagle`` / ``eagle3`` the same random EAGLE head (pdserve/bench/spec_heads.py: what
it costs, not what it proposes; in ``decode`` mode it computes the prompt's rows from zeros,
as a decode worker without shipped rows does). The decode
engine keeps ``--streams`` streams decoding. Per repetition and prompt length, one remote
request: its blocks (and, when shipped, its draft blocks) reserved on the decode side, its task
run by the prefill side's real batch (prefill/batch.py), timed: **the prefill side's part of
its TTFT**; then handed over, and the decode engine's next step timed: in ``decode`` mode it
carries the draft's computation of the prompt, **a stall every decoding stream sees**, against
the median of the steps before the handoff. The two modes alternate every repetition (the
decode engine's proposer is switched between them; the same weights and pools on both sides).

    python bench/spec_pd.py                                  # prompts of 256 and 1024, 4 streams, 5 reps
    python bench/spec_pd.py --prompt-lens 512 --streams 0,8 --reps 9 --json out.json
    python bench/spec_pd.py --method eagle --prompt-lens 1024 --streams 0,4

Prints, per prompt length, streams and mode, the median [min-max] over repetitions of the
prefill batch (ms), the decode step after the handoff and the steps before it (ms), the draft
positions the decode side computed in that step, and the bytes written.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

MODES = ("prefill", "decode")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target model directory (default: the bench's Llama under .cache/)")
    p.add_argument("--method", default="draft_model", choices=["draft_model", "eagle", "eagle3"],
                   help="the proposer on both sides (default draft_model)")
    p.add_argument("--draft-layers", type=int, default=1, help="the draft: the target's first N layers")
    p.add_argument("--prompt-lens", default="256,1024", help="remote prompt lengths, comma-separated")
    p.add_argument("--streams", default="4", help="streams decoding on the decode side, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each mode (alternating)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--json", default=None, help="write every measurement here")
    return p.parse_args(argv)


def default_target() -> str:
    bench = os.path.join(".cache", "models", "pdserve-llama-0992c9fa")
    if os.path.isfile(os.path.join(bench, "config.json")):
        return bench
    from pdserve.bench.engine_throughput import default_model

    return default_model()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


class Pair:
    """The two engines and their transports (the tests' tests/kvtransfer/handoff_pair.py, reduced)."""

    def __init__(self, target: str, method: str, draft: str, k: int):
        from pdserve.engine import LLMEngine
        from pdserve.engine.config import EngineConfig
        from pdserve.kvtransfer.nixl import LOOPBACK_UCX_ENV
        from pdserve.kvtransfer.nixl.tp_transport import open_worker_transport

        spec = {"method": method, "model": draft, "num_speculative_tokens": k, "disable_by_cost": False,
                "acceptance_floor": 0.0, "draft_prompt_kv": "prefill"}
        args = {"speculative_config": spec, "max_num_batched_tokens": 2048, "kv_cache_memory_bytes": 1 << 30}
        self.pe = LLMEngine(EngineConfig.from_kwargs(target, **args))
        self.de = LLMEngine(EngineConfig.from_kwargs(target, **args))
        self.pt = open_worker_transport("p-spec-pd", self.pe, ucx_env=LOOPBACK_UCX_ENV)
        self.dt = open_worker_transport("d-spec-pd", self.de, ucx_env=LOOPBACK_UCX_ENV)
        self.sender = self.pt.sender()
        self.receiver = self.dt.receiver()
        self.peer = self.sender.add_peer(self.dt.record)

    def close(self) -> None:
        self.pt.agent.close()
        self.dt.agent.close()
        self.pe.close()
        self.de.close()

    def handoff(self, prompt: list[int], rid: str) -> dict:
        """One remote request: reserved, prefilled (timed), handed over; then the decode step
        after it (timed) and the draft positions the decode side computed in it."""
        from pdserve.engine import SamplingParams
        from pdserve.kvtransfer import PrefillDone, PrefillTask, decode_notification
        from pdserve.prefill.batch import PrefillBatch
        from pdserve.prefill.values import PrefillStats

        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        res = self.de.connector.reserve(self.de.make_request(prompt, params, request_id=rid))
        assert res is not None, "no room on the decode side"
        task = PrefillTask(rid, 1, prompt, res.cached_len, self.peer, res.block_ids, params.to_dict(),
                           draft_block_ids=list(res.draft_block_ids))
        arrived: list = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                arrived.extend(decode_notification(n.payload) for n in self.receiver.poll().notifications)
                time.sleep(0.0005)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        stats = PrefillStats()
        t0 = time.perf_counter()
        result = PrefillBatch(self.pt.agent.name, self.pe, self.sender, stats, transfer_timeout_s=30.0,
                              layerwise=False).run([task], {})
        prefill_ms = (time.perf_counter() - t0) * 1e3
        deadline = time.monotonic() + 30
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.001)
        stop.set()
        poller.join(5)
        assert result.done == 1 and arrived and isinstance(arrived[0], PrefillDone), (result.failures, arrived)
        done = arrived[0]
        self.de.connector.remote_ready(rid, done.first_token_id, done.first_token_logprob,
                                       draft_tokens=done.draft_tokens)
        draft = self.de.spec.draft
        tokens0 = draft.num_tokens
        t0 = time.perf_counter()
        self.de.step()
        after_ms = (time.perf_counter() - t0) * 1e3
        computed = draft.num_tokens - tokens0
        self.de.abort_request(rid)
        self.de.release(rid)
        return {"prefill_ms": prefill_ms, "after_ms": after_ms, "draft_positions": computed,
                "draft_tokens_shipped": done.draft_tokens, "bytes": stats.bytes_written}


def head(target: str, method: str) -> str:
    """A random EAGLE head of ``method`` for ``target``, written once beside it."""
    from pdserve.bench.spec_heads import make_eagle1, make_eagle3, target_config

    out = f"{target.rstrip('/')}-{method}-head"
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        vocab = target_config(target)["vocab_size"]
        tmp = f"{out}.tmp-{os.getpid()}"
        make_eagle1(tmp, target) if method == "eagle" else make_eagle3(tmp, target, list(range(vocab)))
        os.replace(tmp, out)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.bench.spec import first_layers_draft
    from pdserve.engine import SamplingParams

    target = args.model or default_target()
    draft = first_layers_draft(target, args.draft_layers) if args.method == "draft_model" else head(target, args.method)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    rng = random.Random(0)
    pair = Pair(target, args.method, draft, args.k)
    rows, raw = [], []
    try:
        for n_streams in streams:
            for s in range(n_streams):  # streams that decode through every repetition
                pair.de.add_request([rng.randrange(3, 32000) for _ in range(64)],
                                    SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True),
                                    request_id=f"stream{n_streams}-{s}")
            for _ in range(4):  # their prompts, then decoding
                pair.de.step()
            for length in lens:
                got: dict[str, list[dict]] = {m: [] for m in MODES}
                for rep in range(args.reps + 1):  # (the first round warms both modes up, unrecorded)
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        pair.de.spec.draft.prompt_kv = mode
                        before = []
                        for _ in range(5):
                            t0 = time.perf_counter()
                            pair.de.step()
                            before.append((time.perf_counter() - t0) * 1e3)
                        prompt = [rng.randrange(3, 32000) for _ in range(length)]
                        m = pair.handoff(prompt, f"r{n_streams}-{length}-{rep}-{mode}")
                        m.update(before_ms=statistics.median(before), mode=mode, prompt_len=length,
                                 streams=n_streams, rep=rep)
                        if rep:
                            got[mode].append(m)
                            raw.append(m)
                for mode in MODES:
                    ms = got[mode]
                    rows.append((length, n_streams, mode, spread([m["prefill_ms"] for m in ms]),
                                 spread([m["after_ms"] for m in ms]), spread([m["before_ms"] for m in ms]),
                                 statistics.median(m["draft_positions"] for m in ms),
                                 statistics.median(m["bytes"] for m in ms)))
            for s in range(n_streams):
                pair.de.abort_request(f"stream{n_streams}-{s}")
                pair.de.release(f"stream{n_streams}-{s}")
    finally:
        pair.close()
    print(f"target {target}, {args.method} {draft}; k={args.k}; {args.reps} repetitions per mode "
          "(median [min-max], ms)")
    print("| prompt tokens | streams | draft prompt KV | prefill batch (TTFT side) | decode step after the handoff "
          "| decode steps before | draft positions computed on the decode side | bytes written |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target, "draft": draft, "args": vars(args), "runs": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
