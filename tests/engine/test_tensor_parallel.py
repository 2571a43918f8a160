"""Tensor parallelism inside one worker (engine/tensor_parallel.py, tp_comm.py, tp_group.py):
ranks are real processes; output is token-for-token that of TP=1 and HF transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ConfigError
from pdserve.engine.model_maker import ModelSpec, make_model
from pdserve.engine.tp_comm import new_segment_name
from pdserve.engine.tp_group import TPGroupBroken

from .markers import needs_shm
from .test_hf_parity import hf_greedy, mixed_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 12


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdserve-tp-")}


def greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory):
    """A vocabulary no TP size divides (the last rank's slice is padded) and a 2:1 GQA."""
    return make_model(str(tmp_path_factory.mktemp("tp") / "odd"), ModelSpec(
        num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
        vocab_size=32003, seed=11))


# (model, tp): the split and the replicated KV heads, biases and tied embeddings (qwen2),
# a single KV head replicated on 2 and 4 ranks (mistral), an unevenly split vocabulary.
CASES = [("llama", 2), ("qwen2", 2), ("mistral", 2), ("mistral", 4), ("qwen2", 4), ("odd", 4)]


@needs_shm
@pytest.mark.parametrize("name,tp", CASES)
def test_tp_greedy_equals_tp1_and_hf(model_dirs, odd_vocab_dir, name, tp):
    model_dir = odd_vocab_dir if name == "odd" else model_dirs(name)
    before = segments()
    # Blocks of 16 over prompts of 1-230 tokens: partial last blocks, several chunks per prompt.
    prompts = mixed_prompts(32000, seed=tp)[::3]
    with LLM(model_dir, max_num_batched_tokens=128, tensor_parallel_size=tp) as llm:
        assert llm.engine.runner.tensor_parallel_size == tp
        got = greedy(llm, prompts)
        again = greedy(llm, prompts)  # prefix-cache hits on the second pass
    ref = greedy(LLM(model_dir, max_num_batched_tokens=128), prompts)
    assert got == ref
    assert again == ref
    assert got == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert segments() == before  # the shared segment was unlinked


def test_gloo_collectives_give_the_same_tokens(model_dirs):
    prompts = mixed_prompts(32000, seed=5)[::4]
    with LLM(model_dirs("qwen2"), tensor_parallel_size=2, tp_comm="gloo") as llm:
        got = greedy(llm, prompts)
    assert got == greedy(LLM(model_dirs("qwen2")), prompts)


@pytest.mark.parametrize("args,word", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 must divide the model's num_attention_heads=8"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
    ({"tensor_parallel_size": 2, "tp_comm": "mpi"}, "tp_comm='mpi'"),
    ({"tensor_parallel_size": 2, "tp_comm": "nccl"}, "tp_comm='nccl' needs device='cuda'"),
    ({"tensor_parallel_size": 2, "tp_threads_per_rank": 0}, "tp_threads_per_rank=0"),
])
def test_unusable_tp_settings_are_refused_naming_the_argument(model_dirs, args, word):
    with pytest.raises(ConfigError, match=word.replace("(", r"\(").replace(")", r"\)")):
        LLM(model_dirs("llama"), **args)


@needs_shm
def test_a_killed_rank_breaks_the_engine_with_an_error_naming_it(model_dirs):
    before = segments()
    llm = LLM(model_dirs("mistral"), tensor_parallel_size=2)
    try:
        greedy(llm, [[5, 6, 7]])
        (proc,) = llm.engine.runner.group.procs
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        with pytest.raises(TPGroupBroken, match=r"rank 1 \(pid \d+\) exited with code -9"):
            greedy(llm, [[5, 6, 7]])
        with pytest.raises(TPGroupBroken, match="restart the worker"):  # and every later step
            greedy(llm, [[8, 9]])
    finally:
        llm.close()
    assert segments() == before


@needs_shm
def test_ranks_exit_when_rank_0_is_killed(model_dirs, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, json, time\n"
        "from pdserve.engine import LLM\n"
        f"llm = LLM({model_dirs('mistral')!r}, tensor_parallel_size=4)\n"
        "print(json.dumps([p.pid for p in llm.engine.runner.group.procs]), flush=True)\n"
        "time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(rank0.stdout.readline())
        assert len(pids) == 3
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _running(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}") and _running(p)], "orphaned ranks kept running"
    finally:
        if rank0.poll() is None:
            rank0.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _run_peers(kind: str, size: int, tmp_path, slot: int) -> list[dict]:
    where = new_segment_name() if kind == "shm" else str(_free_port())
    outs = [tmp_path / f"{kind}{r}.pt" for r in range(size)]
    procs = []
    try:
        for r in range(size):
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "tp_comm_peer.py"), kind, str(r),
                                           str(size), where, str(slot), str(outs[r])]))
            deadline = time.monotonic() + 60
            while kind == "shm" and r == 0 and not os.path.exists(f"/dev/shm/{where}"):
                assert time.monotonic() < deadline and procs[0].poll() is None, "rank 0 did not create the segment"
                time.sleep(0.05)
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [torch.load(o) for o in outs]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind,size", [pytest.param("shm", 2, marks=needs_shm), pytest.param("shm", 3, marks=needs_shm),
                                       ("gloo", 2)])
def test_collectives_agree_bit_for_bit_on_every_rank(kind, size, tmp_path):
    before = segments()
    res = _run_peers(kind, size, tmp_path, slot=4096)  # small slots: every big tensor goes in many chunks
    for key in ("big", "small", "ints"):
        want = res[0]["mine"][key].clone()
        for r in range(1, size):
            want += res[r]["mine"][key]
        for r in range(size):
            assert torch.equal(res[r][key], res[0][key]), f"rank {r} holds another {key} than rank 0"
        torch.testing.assert_close(res[0][key], want, rtol=1e-6, atol=1e-3)
    assert [int(g[0, 0]) for g in res[0]["gathered"]] == list(range(size))
    assert all(r["gathered"] is None for r in res[1:])
    assert all(torch.equal(r["header"], torch.arange(4000)) for r in res)
    assert segments() == before


@needs_shm
def test_rank_extensions_get_control_requests_attachments_layer_hooks_and_idle_time(model_dirs, monkeypatch):
    from pdserve.engine.tp_group import TPControlError

    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with LLM(model_dirs("qwen2"), tensor_parallel_size=4, tp_rank_extension="tp_echo_extension:Echo") as llm:
        group = llm.engine.runner.group
        first = group.call("echo", x=[1, 2])
        assert [r["rank"] for r in first] == [1, 2, 3]
        assert all(r["args"] == {"x": [1, 2]} and r["size"] == 4 and r["steps"] == 0 for r in first)
        assert [len(r["big"]) for r in first] == [5000, 10000, 15000]  # replies of different lengths
        assert [r["kv_heads"] for r in first] == [1, 1, 1]  # qwen2: 2 KV heads replicated over 4 ranks
        group.attach({"stream": "a"})
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0))  # one step
        time.sleep(0.05)  # idle long enough for a few idle calls
        after = group.call("echo")
        assert all(r["steps"] == 1 and r["attached"] == [{"stream": "a"}] for r in after)
        assert all(r["layers"] == [0, 1] and r["idled"] for r in after)  # qwen2 test model: 2 layers
        with pytest.raises(TPControlError, match=r"boom: rank 1: ValueError: boom on purpose; rank 2: .*rank 3"):
            group.call("boom")
        # The ranks are still in step after a failed request.
        assert greedy(llm, [[5, 6, 7]]) == greedy(LLM(model_dirs("qwen2")), [[5, 6, 7]])


@needs_shm
def test_control_calls_from_another_thread_wait_for_the_step_in_flight(model_dirs, monkeypatch):
    """A worker's transport calls (add_peer, poll, ...) come from other threads than its engine's
    steps; on shm the two share one message stream and its slots, so each exchange must be
    whole (TPGroup.exchange): steps stay token-exact and every call gets its own replies."""
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]] * 2
    want = greedy(LLM(model_dirs("qwen2")), prompts)
    with LLM(model_dirs("qwen2"), tensor_parallel_size=2, tp_rank_extension="tp_echo_extension:Echo") as llm:
        group, stop, replies, errors = llm.engine.runner.group, threading.Event(), [], []

        def hammer():
            i = 0
            while not stop.is_set():
                try:
                    (rep,) = group.call("echo", i=i)
                    replies.append(rep["args"] == {"i": i})
                except Exception as exc:  # noqa: BLE001  (reported below)
                    errors.append(repr(exc))
                    return
                i += 1

        t = threading.Thread(target=hammer)
        t.start()
        try:
            got = [greedy(llm, prompts) for _ in range(3)]
        finally:
            stop.set()
            t.join(30)
        assert errors == [] and len(replies) > 10 and all(replies)
        assert got == [want] * 3


@needs_shm
def test_control_without_an_extension_is_an_error_not_a_hang(model_dirs):
    from pdserve.engine.tp_group import TPControlError

    with LLM(model_dirs("mistral"), tensor_parallel_size=2) as llm:
        with pytest.raises(TPControlError, match="no extension"):
            llm.engine.runner.group.call("echo")


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_an_hnd_pool_gives_the_tokens_of_an_nhd_pool_and_hf(model_dirs, backend):
    from pdserve.engine import native

    if backend == "native" and native.load() is None:
        pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")
    prompts = mixed_prompts(32000, seed=9)[::2]
    llm = LLM(model_dirs("llama"), kv_layout="HND", attention_backend=backend, max_num_batched_tokens=64)
    pool = llm.engine.runner.kv_cache
    assert tuple(pool.shape[2:5]) == (2, 2, 16)  # [.., K/V, heads, block_size, ..]
    got = greedy(llm, prompts)
    assert got == greedy(LLM(model_dirs("llama"), attention_backend=backend, max_num_batched_tokens=64), prompts)
    assert got == hf_greedy(model_dirs("llama"), prompts, MAX_TOKENS)
