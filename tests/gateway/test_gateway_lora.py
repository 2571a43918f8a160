"""LoRA adapters through the gateway (docs/lora.md, "Through the gateway"), on a real etcd: two
decode workers, one serving the adapter ``sql``. The workers publish their adapters in their
records (``load["lora_adapters"]``); requests for ``sql`` go to the worker serving it and equal
that worker called directly (greedy, token-exact, gRPC and the official OpenAI SDK); an adapter
no worker serves is 404 naming ``model``; /v1/models and ListModels list ``sql`` with its parent;
an adapter loaded and unloaded on a worker at run time is routed to and then refused; `pdserve
status` shows each worker's adapters. The pick itself (pure): only workers serving the adapter
are scored, raced or migrated to, and its reason says so."""

from __future__ import annotations

import json
import random

import grpc
import httpx
import openai
import pytest

from pdserve.api import Client
from pdserve.cli import main
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.cluster.topology import load_topology
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.pick import WorkerState, choose, race_partner
from pdserve.gateway.server import GatewayConfig
from pdserve.launcher import ClusterState, state_path
from tests.decode.test_lora_api import sql_and_chat
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, small_topology_yaml, wait_until

CLUSTER = "gw-lora"
ENGINE = {"max_model_len": 512, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
MAX_TOKENS = 8


def prompt(n: int = 24, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


@pytest.fixture(scope="module")
def paths(llama_dir, tmp_path_factory) -> dict[str, str]:
    return sql_and_chat(llama_dir, tmp_path_factory.mktemp("gw-lora-adapters"))


@pytest.fixture(scope="module")
def cluster(llama_dir, paths, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-lora")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for i, modules in enumerate(([f"sql={paths['sql']}"], [])):
                cfg = DecodeWorkerConfig(model=llama_dir, engine_args=dict(ENGINE), etcd_endpoints=[etcd.endpoint],
                                         cluster=CLUSTER, lease_ttl_s=3, worker_id=f"decode-{i}",
                                         router_policy=str(policy), load_report_s=0.5, served_model_name="base",
                                         lora_modules=modules)
                workers.append(WorkerThread(cfg).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0)).start()
            wait_until(lambda: gw.gateway.backends.adapters() == {"sql": ["decode-0"]}
                       and len(gw.gateway.backends.workers) == 2, 20)
            yield etcd, workers, gw, tmp
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, model: str, ids: list[int]) -> list[int]:
    r = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


def test_requests_for_an_adapter_go_to_the_worker_serving_it_token_exact(cluster):
    _, workers, gw, _ = cluster
    gateway = f"http://{gw.gateway.http_address}"
    with Client(workers[0].grpc) as direct, Client(gw.gateway.grpc_address) as via:
        for seed in range(4):
            ids = prompt(seed=seed)
            want = direct.generate(ids, model="sql", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            base = direct.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert want.token_ids != base.token_ids  # the adapter changes the output: forwarding it matters
            got = via.generate(ids, model="sql", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert got.token_ids == want.token_ids and got.breakdown["worker_id"] == "decode-0"
            assert via.generate(ids, model="base", max_tokens=MAX_TOKENS, temperature=0.0,
                                ignore_eos=True).token_ids == base.token_ids
    ids = prompt(seed=9)
    assert complete(sdk(gateway), "sql", ids) == complete(sdk(workers[0].http), "sql", ids)
    with httpx.Client(base_url=gateway, timeout=60) as h:
        ex = h.post("/gateway/explain", json={"prompt": "Hello there", "model": "sql"}).json()
        base = h.post("/gateway/explain", json={"prompt": "Hello there"}).json()
    assert ex["chosen"] == "decode-0" and "LoRA adapter 'sql'" in ex["reason"], ex
    assert ex["excluded"] == {"decode-1": "does not serve the LoRA adapter 'sql'"}
    assert "LoRA" not in base["reason"] and {s["worker_id"] for s in base["scores"]} == {"decode-0", "decode-1"}


def test_an_adapter_no_worker_serves_is_404_naming_model(cluster):
    _, _, gw, _ = cluster
    with pytest.raises(openai.NotFoundError) as err:
        complete(sdk(f"http://{gw.gateway.http_address}"), "nope", prompt(seed=1))
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    assert err.value.body["code"] == "model_not_found"  # OpenAI's code
    assert "'nope'" in err.value.body["message"] and "sql" in err.value.body["message"]
    with Client(gw.gateway.grpc_address) as via, pytest.raises(grpc.RpcError) as rpc:
        via.generate(prompt(seed=1), model="nope", max_tokens=2)
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "model" in rpc.value.details()


def test_models_through_the_gateway_list_the_adapters_with_their_parent(cluster):
    _, _, gw, _ = cluster
    listed = {m.id: m for m in sdk(f"http://{gw.gateway.http_address}").models.list().data}
    assert set(listed) == {"base", "sql"}
    assert listed["sql"].model_extra["parent"] == "base" and listed["base"].model_extra.get("parent") is None
    with Client(gw.gateway.grpc_address) as via:
        cards = {m["id"]: m for m in via.list_models()}
    assert set(cards) == {"base", "sql"} and cards["sql"]["parent"] == "base"
    with httpx.Client(base_url=f"http://{gw.gateway.http_address}", timeout=30) as h:  # a worker's own, not the gateway's
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_an_adapter_loaded_at_run_time_is_routed_to_and_refused_once_unloaded(cluster, paths):
    """Keys off: the routes work without any key, as before; the worker's record follows each."""
    _, workers, gw, _ = cluster
    backends = gw.gateway.backends
    with httpx.Client(base_url=workers[1].http, timeout=60) as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": paths["chat"]})
        assert r.status_code == 200, r.text
        assert workers[1].worker.registry.info.load["lora_adapters"] == ["chat"]  # published before the 200
        wait_until(lambda: backends.adapters() == {"chat": ["decode-1"], "sql": ["decode-0"]}, 10)
        ids = prompt(seed=5)
        with Client(workers[1].grpc) as direct, Client(gw.gateway.grpc_address) as via:
            want = direct.generate(ids, model="chat", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for _ in range(3):
                got = via.generate(ids, model="chat", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                assert got.token_ids == want.token_ids and got.breakdown["worker_id"] == "decode-1"
        assert {m.id for m in sdk(f"http://{gw.gateway.http_address}").models.list().data} == {"base", "sql", "chat"}
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    wait_until(lambda: backends.adapters() == {"sql": ["decode-0"]}, 10)
    with pytest.raises(openai.NotFoundError):
        complete(sdk(f"http://{gw.gateway.http_address}"), "chat", prompt(seed=5))


def test_pdserve_status_lists_each_workers_adapters(cluster, monkeypatch, capsys):
    from pdserve import status_cmd

    etcd, _, _, tmp = cluster
    topo_file = tmp / "topology.yaml"
    topo_file.write_text(small_topology_yaml(CLUSTER, tmp))
    topo = load_topology(topo_file)
    ClusterState(cluster=CLUSTER, topology=str(topo_file), namespace="ns", ray_address="127.0.0.1:1",
                 ray_head_pid=None, etcd_endpoints=[etcd.endpoint], etcd_pid=None, queue_name="q",
                 model="m").save(state_path(topo))
    monkeypatch.setattr(status_cmd, "_queue_stats_as", lambda topo, state: None)  # Ray is not what this is about
    assert main(["status", "--topology", str(topo_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, ln in enumerate(lines) if ln.startswith("decode-0 "))
    assert lines[row + 1].split() == ["LoRA", "adapters:", "sql"]
    assert "lora_adapters" not in lines[row]
    row1 = next(i for i, ln in enumerate(lines) if ln.startswith("decode-1 "))
    assert sum("LoRA adapters:" in ln for ln in lines) == 1 and "LoRA" not in lines[row1 + 1]  # it serves none
    main(["status", "--topology", str(topo_file), "--json"])
    members = json.loads(capsys.readouterr().out)["members"]
    assert members["decode-0"]["lora_adapters"] == ["sql"] and members["decode-1"]["lora_adapters"] == []


def test_pdserve_gateway_explain_takes_the_adapter(cluster, capsys):
    _, _, gw, _ = cluster
    url = f"http://{gw.gateway.http_address}"
    assert main(["gateway", "explain", "--url", url, "--prompt", "Hello", "--model", "sql"]) == 0
    out = capsys.readouterr().out
    assert "-> decode-0: serves the LoRA adapter 'sql'" in out, out
    assert "decode-1" in out and "excluded: does not serve the LoRA adapter 'sql'" in out


# -- the pick (pure) ------------------------------------------------------------------------

def _workers() -> list[WorkerState]:
    ws = [WorkerState(f"d{i}", f"h:{i}", load={"lora_adapters": names}) for i, names in
          enumerate((["sql"], [], ["chat", "sql"], ["chat"]))]
    ws[0].rate_ms = ws[2].rate_ms = 5.0  # the adapter's workers look slow: the base would go elsewhere
    return ws


def test_the_pick_scores_only_workers_serving_the_adapter_and_says_so():
    ws = _workers()
    rng = random.Random(0)
    assert choose(ws, 100, {}, 0.0, rng).chosen in {"d1", "d3"}
    for seed in range(10):
        p = choose(ws, 100, {}, 0.0, random.Random(seed), adapter="sql")
        assert p.chosen in {"d0", "d2"} and {s.worker_id for s in p.scores} == {"d0", "d2"}
        assert p.reason.startswith("serves the LoRA adapter 'sql' (2 of 4 worker(s) do): ")
        assert p.excluded == {"d1": "does not serve the LoRA adapter 'sql'",
                              "d3": "does not serve the LoRA adapter 'sql'"}
    moved = choose(ws, 100, {}, 0.0, rng, exclude={"d0"}, adapter="sql")  # a migration: d0 failed
    assert moved.chosen == "d2" and moved.excluded["d0"] == "this request already failed on it"
    gone = choose(ws, 100, {}, 0.0, rng, exclude={"d0", "d2"}, adapter="sql")
    assert gone.chosen is None and set(gone.excluded) == {"d0", "d1", "d2", "d3"}
    none = choose(ws, 100, {}, 0.0, rng, adapter="nope")
    assert none.chosen is None and none.reason.startswith("serves the LoRA adapter 'nope' (0 of 4")
    ws[2].load = {"lora_adapters": "sql"}  # not a list: serves nothing
    assert not ws[2].serves("sql") and ws[2].adapters() == []


def test_a_race_under_an_adapter_pairs_two_workers_that_serve_it():
    ws = _workers()
    p = choose(ws, 100, {}, 0.0, random.Random(0), adapter="chat")
    partner, why = race_partner(p, 1.0, 0.0)
    assert why == "race" and {p.chosen, partner} == {"d2", "d3"}
    alone = choose(ws, 100, {}, 0.0, random.Random(0), adapter="sql", exclude={"d2"})
    assert race_partner(alone, 1.0, 0.0) == (None, "one worker")
