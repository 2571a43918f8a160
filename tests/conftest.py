"""Suite-wide pytest setup: the `gpu` marker skips where CUDA is absent; engines a test left to
the cyclic garbage collector are collected before their memory adds up; a process a test left
running (a child of this one at the end of the session) fails the run, naming the test after
which it first appeared."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest

GC_AFTER_GROWTH_MB = 1024

# Ray waits 30 s for a new head's GCS to write its port file, then fails ray.init. Twice on this
# 2-core box (in CI runs) a GCS wrote nothing at all, not even its log, in that time, and a start
# tried again worked (tests/harness.py `start_local_ray`); once, waiting 120 s instead left no
# time for a second start inside pytest's 120 s, and a module's Ray fixture errored with every
# test under it. 40 s: room for a slow start, and for a second one.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "40")


def _rss_mb() -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


_after_last_collect = [_rss_mb()]


@pytest.fixture(autouse=True)
def _collect_engines_left_in_cycles():
    """An engine (its 512 MiB KV pool on the CPU) held in a reference cycle outlives its test
    until a full collection, which the interpreter runs rarely: measured over a whole run,
    this process grew past 17 GiB in steps of one pool per engine test, and the CI box's
    OOM killer ended one run at 20 GiB. After a test that grew the process by more than
    GC_AFTER_GROWTH_MB since the last collection, collect now."""
    yield
    if _rss_mb() - _after_last_collect[0] > GC_AFTER_GROWTH_MB:
        gc.collect()
        _return_freed_heap()
        _after_last_collect[0] = _rss_mb()


def _return_freed_heap() -> None:
    """glibc keeps the small-object heap a collection freed mapped in its arenas; hand it back
    to the system (no-op where the C library has no malloc_trim)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Children of the pytest process that may outlive every test by design: multiprocessing's own
# helpers end with the interpreter.
_EXPECTED_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
STRAY_GRACE_S = 15.0  # a child still exiting (a worker stopped by the last test) gets this long
_first_seen: dict[int, str] = {}  # pid -> the test after which it was first seen


def _children():
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def _note_new_children(request):
    """Which test started each process still running after it (reads /proc: a few ms)."""
    yield
    for child in _children():
        _first_seen.setdefault(child.pid, request.node.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """A process left behind by the suite fails the run: every child of this process still alive
    STRAY_GRACE_S after the last test is listed with its command line and the test after which
    it was first seen, then killed (so CI's box is left clean either way)."""
    import psutil

    def stray(procs):
        out = []
        for p in procs:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if not any(name in cmd for name in _EXPECTED_CHILDREN):
                out.append((p, cmd))
        return out

    left = stray(_children())
    if not left:
        return
    _, alive = psutil.wait_procs([p for p, _ in left], timeout=STRAY_GRACE_S)
    left = stray(alive)
    if not left:
        return
    lines = [f"  pid {p.pid} (first seen after {_first_seen.get(p.pid, 'the last test')}): {cmd[:300]}"
             for p, cmd in left]
    for p, _ in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(left)} process(es) left running by the test suite (killed now):\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    if session.exitstatus == 0:
        session.exitstatus = 1


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either way
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# -- small local models (made once per test session, no hub) ------------------

from pdserve.engine.model_maker import ModelSpec, make_model  # noqa: E402

# Shapes used across the suite. Small enough for a 2-core CPU, but with GQA,
# several layers, and head dims that exercise the real code paths.
MODEL_SPECS = {
    # Llama 3 style: GQA 4:1 heads, llama3 rope scaling, untied embeddings.
    "llama": ModelSpec(arch="llama", num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=2,
                       intermediate_size=256, rope_type="llama3", seed=1),
    # Qwen2: q/k/v biases, tied embeddings, GQA 2:1.
    "qwen2": ModelSpec(arch="qwen2", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                       intermediate_size=256, tie_word_embeddings=True, seed=2),
    "mistral": ModelSpec(arch="mistral", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=1,
                         intermediate_size=256, seed=3),
    # GPU tests: FlashInfer's kernels take head_dim 64/128/256/512 only. GQA 4:1 (its decode
    # wrapper on tensor cores) and 2:1 (its CUDA-core decode kernel).
    "llama_gpu": ModelSpec(arch="llama", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2,
                           intermediate_size=1024, rope_type="llama3", seed=4),
    "qwen2_gpu": ModelSpec(arch="qwen2", num_layers=3, hidden_size=512, num_heads=8, num_kv_heads=4,
                           intermediate_size=1024, tie_word_embeddings=True, seed=5),
}


@pytest.fixture(scope="session", autouse=True)
def _shared_topology_model_cache(tmp_path_factory):
    """One model cache for every cluster tests/harness.py small_topology_yaml describes in this
    session: the first `pdserve up` (or `pdserve worker`, or sweep) makes the tiny model there,
    the others load it (tests/harness.py SHARED_MODEL_CACHE)."""
    try:
        from tests import harness
    except ImportError:  # the serving stack is not installed (bench/gpu_check.sh's GPU machine runs
        yield            # engine and transfer tests only): no cluster to share a cache with
        return
    harness.SHARED_MODEL_CACHE = str(tmp_path_factory.mktemp("topology-models"))
    yield
    harness.SHARED_MODEL_CACHE = None


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Lazily made model directories, keyed by MODEL_SPECS name (or 'default')."""
    made: dict[str, str] = {}
    root = tmp_path_factory.mktemp("models")

    def get(name: str) -> str:
        if name not in made:
            spec = MODEL_SPECS.get(name, ModelSpec())
            made[name] = make_model(str(root / name), spec)
        return made[name]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs("llama")
