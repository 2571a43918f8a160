"""vLLM's LoRA adapter routes with API keys on (docs/lora.md, "The API"; api/http_adapters.py):
no key or a wrong one is 401, a plain key 403 naming ``lora_name`` (nothing is loaded or
unloaded), an operator key loads and unloads, and every key may still run the adapter once
loaded. With keys off the routes need no key (tests/decode/test_lora_api.py,
tests/gateway/test_gateway_lora.py)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.certs import append_key, new_key
from pdserve.decode.worker import DecodeWorkerConfig
from tests.engine.test_lora import make_adapter
from tests.harness import PERMISSIVE_POLICY, WorkerThread

ENGINE = {"max_model_len": 256, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def keyed(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-keys")
    keys = {"user": new_key(), "operator": new_key(), "wrong": new_key()}
    for name in ("user", "operator"):
        append_key(tmp / "keys.txt", keys[name], operator=name == "operator")
    (tmp / "router.yaml").write_text(PERMISSIVE_POLICY)
    adapter = make_adapter(llama_dir, str(tmp / "sql"), 4, 8, ["q_proj", "v_proj"], seed=4)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args=dict(ENGINE), router_policy=str(tmp / "router.yaml"),
                             host="127.0.0.1", served_model_name="base", api_keys_file=str(tmp / "keys.txt"))
    w = WorkerThread(cfg).start()
    try:
        with httpx.Client(base_url=w.http, timeout=60) as h:
            yield h, keys, adapter
    finally:
        w.stop()


def as_(keys: dict, who: str | None) -> dict:
    return {"Authorization": f"Bearer {keys[who]}"} if who else {}


def models(h: httpx.Client, keys: dict) -> set[str]:
    r = h.get("/v1/models", headers=as_(keys, "user"))
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def test_only_an_operator_key_loads_and_unloads_adapters(keyed):
    h, keys, adapter = keyed
    load = {"lora_name": "sql", "lora_path": adapter}
    for who in (None, "wrong"):
        for route, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
            assert h.post(route, json=body, headers=as_(keys, who)).status_code == 401, (route, who)
    r = h.post("/v1/load_lora_adapter", json=load, headers=as_(keys, "user"))
    assert r.status_code == 403 and r.json()["error"]["param"] == "lora_name", r.text
    assert "operator" in r.json()["error"]["message"]
    assert models(h, keys) == {"base"}  # refused before anything was read or served

    r = h.post("/v1/load_lora_adapter", json=load, headers=as_(keys, "operator"))
    assert r.status_code == 200, r.text
    assert models(h, keys) == {"base", "sql"}
    run = {"model": "sql", "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    assert h.post("/v1/completions", json=run, headers=as_(keys, "user")).status_code == 200  # any key runs it

    r = h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=as_(keys, "user"))
    assert r.status_code == 403 and r.json()["error"]["param"] == "lora_name", r.text
    assert models(h, keys) == {"base", "sql"}
    r = h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=as_(keys, "operator"))
    assert r.status_code == 200, r.text
    assert models(h, keys) == {"base"}
