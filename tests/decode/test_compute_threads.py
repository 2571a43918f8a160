"""A decode worker loads and calibrates its engine on threads that end before serving, so the
engine's thread is the only one holding an OpenMP team (common/compute_thread.py: a second
live team throttles libgomp's spin-waits and made every decode step ~1.35x slower,
bench/engine_threads.py)."""

from __future__ import annotations

import threading

import pdserve.decode.worker as worker_mod
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import WorkerThread


def test_engine_loaded_and_calibrated_on_threads_that_end(llama_dir, monkeypatch):
    seen: dict[str, threading.Thread] = {}
    real_engine, real_measure = worker_mod.LLMEngine, worker_mod.measure_steps

    def engine(*args, **kwargs):
        seen["load"] = threading.current_thread()
        return real_engine(*args, **kwargs)

    def measure(eng):
        seen["calibrate"] = threading.current_thread()
        return real_measure(eng)

    monkeypatch.setattr(worker_mod, "LLMEngine", engine)
    monkeypatch.setattr(worker_mod, "measure_steps", measure)
    w = WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 512})).start()
    try:
        assert set(seen) == {"load", "calibrate"}
        engine_thread = w.worker.async_engine._thread
        for what, thread in seen.items():
            assert thread is not threading.main_thread() and thread is not w._thread, what
            assert thread is not engine_thread, what
            thread.join(timeout=10)
            assert not thread.is_alive(), f"the {what} thread is still alive: it keeps an OpenMP team"
    finally:
        w.stop()
