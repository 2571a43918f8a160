"""The engine core in its own process (`engine_core_process`, decode/core_process.py): a real
child process fed over the Unix-socket wire. It serves what the engine in the worker's own
process serves, token for token; a client that leaves frees its blocks there; a core that dies
is an engine death (streams fail UNAVAILABLE, /health 503); a LoRA adapter and a resumed
stream run in it, and its KV events leave from it; what it does not run with yet is refused
naming the setting."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.api import Client
from pdserve.cluster.kvindex.subscriber import KVEventSubscriber
from pdserve.decode.core_client import CoreEngineView, EngineCoreClient
from pdserve.decode.worker import DecodeWorkerConfig, refuse_with_core_process
from pdserve.engine import SamplingParams
from tests.decode.test_lora_api import sql_and_chat
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until

REQUESTS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon a time " * 20, "max_tokens": 8, "temperature": 0, "logprobs": 2},
    {"prompt": "hello hello", "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 2},
    {"prompt": "a b c d e f", "max_tokens": 16, "temperature": 0, "stop": ["e"], "presence_penalty": 0.5},
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "min_tokens": 3},
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "model": "sql"},  # its LoRA adapter
]


def _cfg(llama_dir, policy, core: bool, **kw) -> DecodeWorkerConfig:
    kw.setdefault("engine_args", {"max_model_len": 512})
    return DecodeWorkerConfig(model=llama_dir, router_policy=str(policy), engine_core_process=core, **kw)


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory) -> str:
    """A LoRA adapter whose output differs from the base model's (tests/decode/test_lora_api.py's)."""
    return sql_and_chat(llama_dir, tmp_path_factory.mktemp("core-lora"))["sql"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "router.yaml"
    path.write_text(PERMISSIVE_POLICY)
    return path


@pytest.fixture(scope="module")
def pair(llama_dir, policy, adapter):
    """The same worker twice, serving a LoRA adapter beside the base: the engine in its process,
    and in a core process of its own."""
    lora = {"engine_args": {"max_model_len": 512, "enable_lora": True}, "lora_modules": [f"sql={adapter}"]}
    here = WorkerThread(_cfg(llama_dir, policy, False, **lora)).start()
    try:
        core = WorkerThread(_cfg(llama_dir, policy, True, **lora)).start()
    except BaseException:
        here.stop()
        raise
    yield here, core
    core.stop()
    here.stop()


def _choices(base: str, body: dict) -> list:
    with httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return [(c["text"], c["finish_reason"], c.get("logprobs")) for c in r.json()["choices"]]


def test_the_core_process_serves_token_for_token_what_the_engine_in_process_serves(pair):
    here, core = pair
    client = core.worker.async_engine
    assert isinstance(client, EngineCoreClient) and isinstance(core.worker.engine, CoreEngineView)
    assert client.proc.pid != os.getpid() and client.proc.poll() is None
    with ThreadPoolExecutor(len(REQUESTS)) as pool:  # concurrent: the core batches them
        theirs = list(pool.map(lambda b: _choices(core.http, b), REQUESTS))
    ours = [_choices(here.http, b) for b in REQUESTS]
    assert theirs == ours
    assert theirs[-1] != theirs[0]  # the adapter's output is not the base's: it ran in the core
    assert any(reason == "stop" for got in theirs for _, reason, _ in got)
    # The router's reads cross to the core: a prompt served once is in the core's prefix cache.
    ids = core.worker.frontend.tokenizer.encode(REQUESTS[1]["prompt"])
    assert core.worker.frontend.cached_len(ids) > 0
    load = core.worker.engine.load()
    assert (load.running, load.waiting) == (0, 0)
    stats, ref = core.worker.stats(), here.worker.stats()  # (both count their calibration's requests too)
    assert stats["engine_alive"] and stats["num_finished"] == ref["num_finished"] > sum(b.get("n", 1) for b in REQUESTS)
    assert stats["num_generation_tokens"] == ref["num_generation_tokens"]
    # /metrics reports the core's threads beside the API process's: the step's CPU is there
    metrics = httpx.get(f"{core.http}/metrics", timeout=30).text
    engine_cpu = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("pdserve_thread_cpu_seconds_total{") and 'thread="core/pdserve-engine"' in line]
    assert engine_cpu and engine_cpu[0] > 0


def test_a_stream_resumed_on_the_core_continues_token_exact(pair):
    """A migrated stream's resume_token_ids cross to the core (the gateway's migration)."""
    _, core = pair
    ids = [(7 * i + 3) % 31000 + 3 for i in range(30)]
    with Client(core.grpc) as c:
        whole = c.generate(ids, max_tokens=16, ignore_eos=True, temperature=0.0)
        rest = c.generate(ids, max_tokens=16, ignore_eos=True, temperature=0.0, resume_token_ids=whole.token_ids[:5])
    assert whole.token_ids[:5] + rest.token_ids == whole.token_ids
    assert rest.breakdown["reason"].startswith("resumed")


def test_a_client_that_leaves_frees_its_blocks_in_the_core(pair):
    _, core = pair
    eng = core.worker.engine
    before = eng.stats.num_generation_tokens
    with httpx.Client(base_url=core.http, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={"prompt": "tell me " * 30, "max_tokens": 400,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got: list[str] = []
            for line in lines:
                if line.startswith("data: {"):
                    got.append(line)
                if len(got) >= 3:
                    break  # leave mid-stream
    wait_until(lambda: eng.load().running == 0 and eng.load().num_free_blocks == eng.load().num_blocks, 20)
    assert eng.stats.num_generation_tokens - before < 400  # aborted in the core, not run to its end


def test_what_the_core_process_does_not_run_with_is_refused_naming_the_setting(llama_dir, policy):
    with pytest.raises(ValueError, match="engine_core_process"):
        refuse_with_core_process(DecodeWorkerConfig(model=llama_dir, engine_core_process=True, remote_prefill=True),
                                 None)
    refuse_with_core_process(DecodeWorkerConfig(model=llama_dir, engine_core_process=True), None)  # (the rest runs)


def test_a_core_that_dies_fails_its_streams_unavailable_and_the_worker_says_so(llama_dir, policy):
    w = WorkerThread(_cfg(llama_dir, policy, True, calibrate=False,
                          engine_args={"max_model_len": 512, "kv_events": True})).start()
    try:
        client = w.worker.async_engine
        assert isinstance(client, EngineCoreClient)
        # Its KV events leave from the core, at the endpoints the worker's record names: a
        # subscriber's view of its cache fills as a prompt is served.
        eps = w.worker._record().endpoints
        with KVEventSubscriber(f"tcp://{eps['kv_events']}", f"tcp://{eps['kv_events_replay']}") as sub:
            with httpx.Client(base_url=w.http, timeout=60) as h:
                assert h.post("/v1/completions", json={"prompt": "stored " * 40, "max_tokens": 2}).status_code == 200
            wait_until(lambda: sub.poll(0.1) >= 0 and len(list(sub.view.hashes())) > 0, 20)
        with httpx.Client(base_url=w.http, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json={"prompt": "go on " * 20, "max_tokens": 400,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "stream": True}) as r:
                assert r.status_code == 200
                events = []
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(client.proc.pid, signal.SIGKILL)
                    if line == "data: [DONE]":
                        break
            errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
            assert errors and errors[0]["code"] == 503 and "engine" in errors[0]["message"], events[-3:]
            wait_until(lambda: not client.alive, 10)
            assert h.get("/health").status_code == 503
            # monitoring still answers: the last figures read, the engine reported dead
            metrics = h.get("/metrics")
            assert metrics.status_code == 200 and "pdserve_engine_alive" in metrics.text
            assert any(line.startswith("pdserve_engine_alive{") and line.endswith(" 0.0")
                       for line in metrics.text.splitlines())
            assert w.worker.stats()["engine_alive"] is False
            r = h.post("/v1/completions", json={"prompt": "again", "max_tokens": 2})
            assert r.status_code == 503, r.text
    finally:
        w.stop()
    assert client.proc.poll() is not None


def test_a_failing_step_callback_is_logged_and_the_streams_go_on(llama_dir):
    """An `on_step` that raises (the worker's cost model, say) must not stop the frames: the
    stream still ends, as an event loop's failed callback does not stop the next one."""
    calls = []

    def on_step(info):
        calls.append(info)
        if len(calls) == 1:
            raise RuntimeError("a callback's bug")

    async def run():
        client = await EngineCoreClient.launch(llama_dir, {"max_model_len": 256}, on_step=on_step)
        try:
            q = client.submit("r1", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), 0)
            got = []
            while True:
                item, final = await asyncio.wait_for(q.get(), 30)
                got += item.new_token_ids
                if item.finished:
                    break
            return got, final, client.alive
        finally:
            client.stop()

    got, final, alive = asyncio.run(run())
    assert len(got) == 6 and final is not None and final.completion_tokens == 6 and alive
    assert len(calls) > 1
