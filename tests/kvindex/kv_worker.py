"""A worker-like child process for the KV event tests: an engine recording KV events and a
publisher sending them; the test drives it over a pipe (generate, report its cache, exit)."""

from __future__ import annotations

from typing import Any


def kv_worker_main(conn: Any, model: str, num_blocks: int, max_pending: int, interval_s: float) -> None:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.cluster.kvindex.publisher import KVEventPublisher

    llm = LLM(model, kv_events=True, num_gpu_blocks_override=num_blocks, block_size=4, device="cpu")
    eng = llm.engine
    eng.kv_events.max_pending = max_pending
    with KVEventPublisher(eng.kv_events, interval_s=interval_s) as pub:
        conn.send({"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint})
        while True:
            cmd = conn.recv()
            if cmd["op"] == "generate":
                llm.generate(cmd["prompts"], SamplingParams(max_tokens=cmd.get("max_tokens", 3), temperature=0.0))
                conn.send("ok")
            elif cmd["op"] == "cached":
                conn.send({"pool": sorted(eng.kv.pool.cached), "log": sorted(eng.kv_events.cached_hashes()),
                           "gaps": eng.kv_events.gaps, "published": pub.published})
            elif cmd["op"] == "exit":
                conn.send("bye")
                return
