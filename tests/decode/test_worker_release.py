"""A stopped decode worker leaves nothing holding its engine: a process that starts and stops
workers (this test suite, a program embedding them) gets their weights and KV pool back."""

from __future__ import annotations

import gc
import weakref

import httpx

from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread


def _holders(obj) -> list[str]:
    return [type(r).__name__ for r in gc.get_referrers(obj) if not isinstance(r, list)]


def test_a_stopped_worker_frees_its_engine(llama_dir):
    cfg = DecodeWorkerConfig(model=llama_dir, calibrate=False,
                             engine_args={"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20})
    w = WorkerThread(cfg).start()
    try:  # both servers answer a call first: whatever they cache per endpoint is filled
        assert httpx.get(f"{w.http}/v1/models", timeout=10).status_code == 200
        completion = httpx.post(f"{w.http}/v1/completions", timeout=30,
                                json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True})
        assert completion.status_code == 200, completion.text
    finally:
        w.stop()
    engine, worker = weakref.ref(w.worker.engine), weakref.ref(w.worker)
    del w
    gc.collect()
    assert worker() is None, f"the stopped worker is still held by {_holders(worker())}"
    assert engine() is None, f"the stopped worker's engine is still held by {_holders(engine())}"
