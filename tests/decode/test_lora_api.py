"""LoRA adapters through the serving APIs (docs/lora.md, "The API"): a decode worker started with
an adapter (``lora_modules``) answers the official OpenAI SDK with ``model=<adapter>`` exactly as
the offline engine does with that adapter (greedy), the base model is unaffected, /v1/models and
ListModels list the adapters, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter work
while another adapter's stream runs (which continues token-exact), an unknown adapter is 404
naming model, a bad adapter 400 naming lora_path, the router keeps adapter requests local
(reason ``lora_adapter``) and /metrics counts per adapter."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from pdserve.api import Client
from pdserve.api.adapters import parse_lora_modules
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine import LLM, LoRARequest, SamplingParams
from tests.engine.test_lora import make_adapter
from tests.harness import PERMISSIVE_POLICY, WorkerThread

MAX_TOKENS = 10
LONG = 200  # the stream that runs through the loads and unloads
ENGINE = {"max_model_len": 512, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16}


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


PROMPT = ids(20, seed=3)


def amplified(path: str, factor: float = 20.0) -> str:
    """The adapter at ``path`` with its B weights scaled (a delta large enough to change the tiny
    random model's greedy output from the first tokens on)."""
    from safetensors.torch import load_file, save_file

    f = f"{path}/adapter_model.safetensors"
    weights = load_file(f)
    save_file({k: v * factor if "lora_B" in k else v for k, v in weights.items()}, f)
    return path


def sql_and_chat(llama_dir: str, root) -> dict[str, str]:
    """Two adapters under ``root`` whose outputs differ from the base's (the LoRA cluster tests'):
    ``sql`` (rank 8 on q, v, down) and ``chat`` (rank 4 on k, o, up)."""
    return {"sql": amplified(make_adapter(llama_dir, str(root / "sql"), 8, 16, ["q_proj", "v_proj", "down_proj"],
                                          seed=1)),
            "chat": amplified(make_adapter(llama_dir, str(root / "chat"), 4, 8, ["k_proj", "o_proj", "up_proj"],
                                           seed=2))}


@pytest.fixture(scope="module")
def paths(llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-api")
    return {**sql_and_chat(llama_dir, root),
            "too_wide": make_adapter(llama_dir, str(root / "too_wide"), 32, 32, ["q_proj"], seed=3)}


@pytest.fixture(scope="module")
def offline(llama_dir, paths) -> dict[str, list[int]]:
    """The offline engine's greedy tokens per adapter (None: the base), long and short runs."""
    llm = LLM(llama_dir, **ENGINE)
    out: dict = {}
    for name, lora_id in (("sql", 1), ("chat", 2), (None, 0)):
        lora = LoRARequest(name, lora_id, paths[name]) if name else None
        for n in (MAX_TOKENS, LONG):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            out[(name, n)] = llm.generate([PROMPT], params, lora_request=lora)[0].token_ids
    llm.close()
    return out


@pytest.fixture(scope="module")
def lora_worker(llama_dir, paths, tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args=dict(ENGINE), router_policy=str(policy),
                             served_model_name="base", lora_modules=[f"sql={paths['sql']}"])
    w = WorkerThread(cfg).start()
    yield w
    w.stop()


def sdk(worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.http}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, model: str, n: int = MAX_TOKENS) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


def test_adapter_by_model_equals_the_offline_engine_and_base_is_unaffected(lora_worker, offline):
    client = sdk(lora_worker)
    # each adapter changes the output
    assert len({tuple(offline[(name, MAX_TOKENS)]) for name in ("sql", "chat", None)}) == 3
    assert complete(client, "sql") == offline[("sql", MAX_TOKENS)]
    assert complete(client, "base") == offline[(None, MAX_TOKENS)]
    with Client(lora_worker.grpc) as c:  # gRPC: GenerateRequest.model names the adapter the same way
        assert c.generate(PROMPT, model="sql", max_tokens=MAX_TOKENS, temperature=0.0,
                          ignore_eos=True).token_ids == offline[("sql", MAX_TOKENS)]
        assert c.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                          ignore_eos=True).token_ids == offline[(None, MAX_TOKENS)]


def test_models_list_the_adapters_with_their_parent(lora_worker, paths):
    listed = {m.id: m for m in sdk(lora_worker).models.list().data}
    assert set(listed) == {"base", "sql"}
    assert listed["sql"].model_extra["parent"] == "base" and listed["sql"].model_extra["root"] == paths["sql"]
    assert listed["base"].model_extra.get("parent") is None
    with Client(lora_worker.grpc) as c:
        cards = {m["id"]: m for m in c.list_models()}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == paths["sql"] and "parent" not in cards["base"]


def test_unknown_adapter_is_404_naming_model(lora_worker):
    with pytest.raises(openai.NotFoundError) as err:
        complete(sdk(lora_worker), "nope")
    assert err.value.status_code == 404 and err.value.body["param"] == "model"
    assert err.value.body["code"] == "model_not_found"  # OpenAI's code
    with httpx.Client(base_url=lora_worker.http, timeout=60) as h:
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_bad_adapter_is_400_naming_the_field(lora_worker, paths, tmp_path):
    with httpx.Client(base_url=lora_worker.http, timeout=60) as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": paths["too_wide"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert "max_lora_rank" in r.json()["error"]["message"] and "[r]" in r.json()["error"]["message"]
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "empty", "lora_path": str(tmp_path)})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
        r = h.post("/v1/load_lora_adapter", json={"lora_path": paths["sql"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text  # already loaded
    assert {m.id for m in sdk(lora_worker).models.list().data} == {"base", "sql"}


def test_load_and_unload_while_another_adapters_stream_runs(lora_worker, paths, offline):
    client = sdk(lora_worker)
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got: list[int] = []
    chunks = iter(stream)
    got += next(chunks).choices[0].model_extra["token_ids"]  # it is running
    with httpx.Client(base_url=lora_worker.http, timeout=60) as h:
        # the running adapter is not unloaded under its stream (409); an idle one is
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 409 and r.json()["error"]["param"] == "lora_name", r.text
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": paths["chat"]})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        assert complete(client, "chat") == offline[("chat", MAX_TOKENS)]
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "chat")
    for chunk in chunks:
        got += chunk.choices[0].model_extra["token_ids"]
    assert got == offline[("sql", LONG)]  # token-exact through the loads and unloads
    with httpx.Client(base_url=lora_worker.http, timeout=60) as h:  # loaded again from the same path: served
        assert h.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": paths["chat"]}).status_code == 200
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": paths["chat"]})
        assert r.status_code == 200, r.text
        assert complete(client, "chat") == complete(client, "chat2") == offline[("chat", MAX_TOKENS)]
        for name in ("chat", "chat2"):
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_adapter_requests_stay_local_and_are_counted(lora_worker):
    with Client(lora_worker.grpc) as c:
        for route in ("auto", "remote"):  # even asked remote: a prefill worker cannot run the adapter
            out = c.generate(PROMPT + [3 if route == "auto" else 4], model="sql", max_tokens=3, temperature=0.0, route=route)
            assert out.breakdown["route"] == "local" and out.breakdown["reason"].startswith("lora_adapter:"), \
                out.breakdown
        base = c.generate(PROMPT + [7], max_tokens=3, temperature=0.0)
        assert not base.breakdown["reason"].startswith("lora_adapter")
    with httpx.Client(base_url=lora_worker.http, timeout=60) as h:
        text = h.get("/metrics").text
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("pdserve_lora_")}
    req = [v for k, v in lines.items() if k.startswith("pdserve_lora_requests_total") and 'lora_name="sql"' in k]
    gen = [v for k, v in lines.items() if k.startswith("pdserve_lora_generation_tokens_total") and 'lora_name="sql"' in k]
    assert req and req[0] >= 2 and gen and gen[0] >= 6
    assert not any('lora_name="base"' in k for k in lines)


def test_lora_modules_are_checked_naming_the_entry(llama_dir, paths):
    assert [m.name for m in parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])] \
        == ["a", "b"]
    for bad, field in ((["a"], "lora_modules[0]"), (["a=/x", "a=/y"], "lora_modules[1].name"),
                       ([{"name": "a"}], "lora_modules[0].path"), ([{"name": "a", "path": "/x", "x": 1}],
                                                                      "lora_modules[0].x")):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_lora_modules(bad)
