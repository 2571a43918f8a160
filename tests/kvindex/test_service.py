"""The cluster KV index as a service, against a real decode worker and a real etcd: the
worker's engine records KV events (engine arg kv_events), lists its publisher in its etcd
record, the index follows it and answers who holds a prompt's prefix over HTTP; when the
worker leaves the cluster it leaves the index."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from pdserve.api import Client
from pdserve.cli import main
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine.tokenizer import Tokenizer
from pdserve.cluster.kvindex.service import KVIndexService, wait_synced
from pdserve.state import ClusterState
from tests.harness import WorkerThread, small_topology_yaml, wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server


class ServiceThread:
    """The index on its own event loop (as its process runs it)."""

    def __init__(self, etcd, cluster: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.svc = KVIndexService([etcd.endpoint], cluster)
        self.call(self.svc.start)

    def call(self, fn, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout_s)

    def stop(self):
        try:
            self.call(self.svc.stop)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_index_follows_a_worker_in_the_cluster_and_explains_a_prompts_prefix(etcd, llama_dir, capsys):
    d = WorkerThread(DecodeWorkerConfig(
        model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster="kvidx", lease_ttl_s=3, worker_id="decode-0",
        engine_args={"kv_events": True, "device": "cpu", "block_size": 4})).start()
    svc = None
    try:
        svc = ServiceThread(etcd, "kvidx")
        wait_synced(svc.svc, ["decode-0"], 30)
        system = "You are a careful assistant who answers in one short sentence. " * 2
        prompt = system + "What is the capital of France?"
        tokens = Tokenizer(llama_dir).encode(prompt)
        status, before = _post(svc.svc.url + "/explain", {"token_ids": tokens})
        assert status == 200 and before["workers"] == [
            {"worker_id": "decode-0", "cached_blocks": 0, "cached_tokens": 0, "by_medium": {}}]
        with Client(d.grpc) as c:
            c.generate(prompt, max_tokens=2, temperature=0.0)
        full = (len(tokens) - 1) // 4  # the blocks the engine caches (it always recomputes the last token)

        def cached():
            return _post(svc.svc.url + "/explain", {"token_ids": tokens})[1]["workers"][0]["cached_blocks"]

        wait_until(lambda: cached() >= full, 20)
        assert cached() == len(d.worker.engine.kv.pool.lookup(svc.svc.index.prompt_hashes(tokens)))
        after = _post(svc.svc.url + "/explain", {"token_ids": tokens})[1]["workers"][0]
        assert after["by_medium"] == {"CPU": after["cached_blocks"]}
        st = json.loads(_get(svc.svc.url + "/status")[1])
        assert st["workers"]["decode-0"]["blocks"] == len(d.worker.engine.kv.pool.cached) and st["block_size"] == 4
        metrics = _get(svc.svc.url + "/metrics")[1].decode()
        assert 'pdserve_kvindex_prefix_hit_blocks_total{worker="decode-0",medium="CPU"} ' in metrics
        assert 'pdserve_kvindex_blocks{worker="decode-0",medium="CPU"}' in metrics
        # Bad input is a typed error naming the field, never a crash.
        for bad in ({}, {"token_ids": []}, {"token_ids": ["a"]}, {"token_ids": [-1]}, [1, 2]):
            code, body = _post(svc.svc.url + "/explain", bad)
            assert code == 400 and "token_ids" in body["error"]
        assert _get(svc.svc.url + "/nope")[0] == 404
        # The operator's commands read the same answers.
        capsys.readouterr()
        assert main(["kv", "explain", "--url", svc.svc.url, "--prompt", prompt, "--model", llama_dir]) == 0
        out = capsys.readouterr().out
        assert "decode-0" in out and f"{after['cached_blocks']} blocks cached" in out and "CPU" in out
        assert main(["kv", "status", "--url", svc.svc.url]) == 0
        assert "decode-0" in capsys.readouterr().out
    finally:
        d.stop()
    try:
        # The worker left etcd (deregistered on stop): it leaves the index.
        wait_until(lambda: "decode-0" not in svc.svc.status()["workers"], 20)
    finally:
        svc.stop()


def test_the_kv_commands_find_the_index_that_up_started(etcd, tmp_path, capsys):
    """Without --url, `pdserve kv status/explain` read the KV index's address from the state
    file of the cluster `pdserve up` started for --topology (kv_index.enabled); a cluster that
    runs none, or no cluster, is an error that says what to change."""
    topo = tmp_path / "topology.yaml"
    topo.write_text(small_topology_yaml("kvup", tmp_path) + "kv_index: {enabled: true}\n")
    capsys.readouterr()
    assert main(["kv", "status", "--topology", str(topo)]) == 2
    assert "pdserve up" in capsys.readouterr().err
    state = ClusterState(cluster="kvup", topology=str(topo), namespace="pdserve", ray_address="", ray_head_pid=None,
                         etcd_endpoints=[etcd.endpoint], etcd_pid=None, queue_name="q", model="m",
                         actors=[{"name": "kvup-decode-0", "role": "decode", "worker_id": "decode-0"}])
    path = tmp_path / "runs" / "kvup.state.json"
    state.save(path)
    assert main(["kv", "status", "--topology", str(topo)]) == 2
    assert "kv_index: {enabled: true}" in capsys.readouterr().err
    svc = ServiceThread(etcd, "kvup")
    try:
        state.actors.append({"name": "kvup-kv-index", "role": "kv-index", "worker_id": "kv-index",
                             "url": svc.svc.url})
        state.save(path)
        assert main(["kv", "status", "--topology", str(topo)]) == 0
        assert "cluster kvup" in capsys.readouterr().out
        assert main(["kv", "explain", "--topology", str(topo), "--token-ids", "1,2,3"]) == 0
        assert "no worker publishes KV events" in capsys.readouterr().out
    finally:
        svc.stop()
