"""Structured outputs, vLLM's sampling controls and tool calling through the gateway: it
forwards every sampling field to the worker it picks (a stream through it equals one from a
worker called directly), refuses a grammar that does not compile at its own edge before any
worker is picked, serves tool_choice with its own chat options (`pdserve gateway
--enable-auto-tool-choice --tool-call-parser ... --reasoning-parser ...`), and a constrained
stream whose worker dies resumes on another worker token-exact, its grammar intact.

The model has random weights: grammars whose sentences are bounded end by themselves; the
regex of the migration test is too long to end within max_tokens, so those streams run to length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Annotated, Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from pdserve.api import AsyncClient, Client
from pdserve.api.client import build_request
from pdserve.api.grpc_service import input_from_proto
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.engine.request import SamplingParams
from pdserve.gateway.forward import SAMPLING, sampling_of
from pdserve.gateway.server import GatewayConfig
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, small_topology_yaml, wait_until

CLUSTER = "gw-structured"
WORKERS = ("decode-0", "decode-1")
SAMPLED = [dict(temperature=0.0), dict(temperature=1.0, seed=7)]


class Item(BaseModel):
    """Bounded everywhere: any path through its grammar ends within max_tokens."""

    name: str = Field(max_length=10)
    color: Literal["red", "green", "blue"]
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=3)
    in_stock: bool


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "ping": {"type": "object", "maxProperties": 0}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
# Bounded, and long enough (20-24 items) that its stream is still running when its worker dies.
WORDS = {"type": "object", "properties": {"words": {"type": "array", "minItems": 20, "maxItems": 24, "items": {
    "enum": ["alpha", "beta", "gamma", "delta"]}}}, "required": ["words"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gws")
    policy = tmp / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    with EmbeddedEtcd(tmp / "etcd") as etcd:
        workers, gw = [], None
        try:
            for wid in WORKERS:  # the workers read no chat output here: the gateway's HTTP route does
                cfg = DecodeWorkerConfig(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER,
                                         engine_args={"max_model_len": 2048}, lease_ttl_s=3, worker_id=wid,
                                         router_policy=str(policy), load_report_s=0.5)
                workers.append(WorkerThread(cfg).start())
            gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0,
                                             enable_auto_tool_choice=True, tool_call_parser="hermes",
                                             reasoning_parser="qwen3")).start()
            wait_until(lambda: len(gw.gateway.backends.workers) == len(WORKERS), 20)
            yield workers, gw
        finally:
            if gw is not None:
                gw.stop()
            for w in workers:
                w.stop()


def no_leaks(workers):
    for w in workers:
        eng = w.worker.engine
        wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15)


def routed(gw) -> float:
    """Sequences the gateway has sent to a worker so far (first attempts)."""
    reg = gw.gateway.frontend.metrics.registry
    return sum(s.value for m in reg.collect() if m.name == "pdserve_gateway_routed"
               for s in m.samples if s.name.endswith("_total"))


# -- what the worker is given -----------------------------------------------------------------
def test_every_sampling_field_crosses_to_the_worker():
    """Each field of SamplingParams but skip_special_tokens (the worker's text is its own) goes
    on the gateway's call to the worker, and comes out there as it went in."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names - set(SAMPLING) == {"skip_special_tokens"} and set(SAMPLING) <= names
    full = SamplingParams(max_tokens=30, temperature=0.7, top_k=5, top_p=0.9, seed=3, presence_penalty=0.1,
                          frequency_penalty=0.2, repetition_penalty=1.1, logprobs=2, stop=["x"], stop_token_ids=[9],
                          ignore_eos=True, min_p=0.05, min_tokens=2, logit_bias={5: 1.5, 7: -100.0},
                          allowed_token_ids=[5, 7, 11], bad_words=["zebra"], prompt_logprobs=1,
                          structured_outputs={"json": json.dumps(WORDS), "disable_any_whitespace": True,
                                              "disable_additional_properties": False})
    for params in (full, SamplingParams(), SamplingParams(structured_outputs={"choice": ["a", "b"]}),
                   SamplingParams(structured_outputs={"json_object": True})):
        got = input_from_proto(build_request([1, 2, 3], **sampling_of(params))).params
        assert got == params


# -- the gateway's chat options: flags, or the topology's decode workers' settings --------------
def test_chat_options_come_from_the_flags_or_the_topologys_decode_role(tmp_path, capsys):
    from pdserve.cli import main
    from pdserve.cluster.topology import load_topology
    from pdserve.gateway.actor import gateway_config

    base = ["gateway", "--etcd", "10.0.0.5:2379", "--cluster", "c", "--model", str(tmp_path)]
    assert main([*base, "--enable-auto-tool-choice", "--check"]) == 2
    assert "enable_auto_tool_choice: needs tool_call_parser (--tool-call-parser)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:
        main([*base, "--tool-call-parser", "nope", "--check"])
    assert ended.value.code == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    topo = tmp_path / "topology.yaml"
    topo.write_text(small_topology_yaml("c", tmp_path).replace(
        "    ports: {grpc: 0, http: 0}\n", "    ports: {grpc: 0, http: 0}\n    enable_auto_tool_choice: true\n"
        "    tool_call_parser: hermes\n    reasoning_parser: deepseek_r1\n"))
    assert main([*base, "--topology", str(topo), "--check"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("tool_choice auto; tool call parser hermes; reasoning parser "
                                                     "deepseek_r1")
    assert main([*base, "--topology", str(topo), "--reasoning-parser", "qwen3", "--check"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("tool call parser hermes; reasoning parser qwen3")
    # `pdserve up`'s gateways: the same settings as the decode workers they front
    cfg = gateway_config(load_topology(str(topo)), 0, str(tmp_path), ["10.0.0.5:2379"])
    cfg.pop("bind")
    options = GatewayConfig(**cfg).chat_options()
    assert (options.enable_auto_tool_choice, options.tool_call_parser, options.reasoning_parser) == \
        (True, "hermes", "deepseek_r1")


# -- gRPC through the gateway -----------------------------------------------------------------
CONSTRAINTS = [
    ({"regex": r"(yes|no)-[0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no)-[0-9]{2}", t)),
    ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"grammar": 'root ::= "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ({"json": Item.model_json_schema(), "disable_any_whitespace": True}, Item.model_validate_json),
]


def test_structured_outputs_through_the_gateway_equal_a_worker(cluster):
    workers, gw = cluster
    with Client(workers[0].grpc) as direct, Client(gw.gateway.grpc_address) as via:
        for so, holds in CONSTRAINTS:
            for kw in SAMPLED:
                want = direct.generate("Answer:", max_tokens=200, structured_outputs=so, **kw)
                got = via.generate("Answer:", max_tokens=200, structured_outputs=so, **kw)
                assert got.finish_reason == "stop" and holds(got.text), (so, kw, got.text)
                assert (got.token_ids, got.text) == (want.token_ids, want.text)
    no_leaks(workers)


def test_sampling_controls_through_the_gateway_equal_a_worker(cluster):
    workers, gw = cluster
    cases = [dict(logit_bias={1000: 100.0}, ignore_eos=True, max_tokens=4, temperature=0.0),
             dict(allowed_token_ids=[7, 8], ignore_eos=True, max_tokens=6, temperature=1.0, seed=3),
             dict(min_p=0.3, min_tokens=5, bad_words=["zebra"], max_tokens=8, temperature=1.0, seed=1),
             dict(structured_outputs={"regex": "[a-c]{3}"}, min_p=0.5, allowed_token_ids=list(range(32000)),
                  max_tokens=48, temperature=0.0)]
    with Client(workers[1].grpc) as direct, Client(gw.gateway.grpc_address) as via:
        outs = [(direct.generate("Answer:", **kw), via.generate("Answer:", **kw)) for kw in cases]
    for (want, got) in outs:
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert outs[0][1].token_ids == [1000] * 4 and set(outs[1][1].token_ids) <= {7, 8}
    assert len(outs[2][1].token_ids) >= 5 and re.fullmatch("[a-c]{3}", outs[3][1].text)


@pytest.mark.parametrize("so, field", [
    ({"regex": "("}, "structured_outputs.regex"),
    ({"json": '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'}, "structured_outputs.json"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_a_bad_grammar_is_refused_at_the_gateway_before_any_worker(cluster, so, field):
    workers, gw = cluster
    before, mine = routed(gw), gw.gateway.frontend.checker.grammars.stats()
    theirs = [w.worker.engine.grammar_stats() for w in workers]
    with Client(gw.gateway.grpc_address) as c, pytest.raises(grpc.RpcError) as info:
        c.generate("Answer:", max_tokens=4, structured_outputs=so)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(f"{field}:")
    r = httpx.post(f"http://{gw.gateway.http_address}/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 4, "structured_outputs": so})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert routed(gw) == before  # no worker was picked for either
    now = gw.gateway.frontend.checker.grammars.stats()  # the gateway's own compiler was asked, twice
    assert now["hits"] + now["misses"] - mine["hits"] - mine["misses"] >= 2
    assert [w.worker.engine.grammar_stats() for w in workers] == theirs


# -- HTTP through the gateway: the OpenAI SDK --------------------------------------------------
@pytest.fixture(scope="module")
def sdks(cluster):
    workers, gw = cluster
    with OpenAI(base_url=f"http://{gw.gateway.http_address}/v1", api_key="not-used", max_retries=0,
                timeout=120) as via, OpenAI(base_url=f"{workers[0].http}/v1", api_key="not-used", max_retries=0,
                                            timeout=120) as direct:
        yield via, direct


def test_prompt_logprobs_through_the_gateway_equal_a_worker(cluster, sdks):
    """vLLM's prompt_logprobs cross the gateway: gRPC's first message, then OpenAI's shapes
    (completions per choice, chat at the top level), equal to the worker's own answer."""
    workers, gw = cluster
    via, direct = sdks
    with Client(workers[0].grpc) as d, Client(gw.gateway.grpc_address) as g:
        want = d.generate("Answer: yes", max_tokens=2, temperature=0.0, prompt_logprobs=2)
        got = g.generate("Answer: yes", max_tokens=2, temperature=0.0, prompt_logprobs=2)
    assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) > 2
    assert got.prompt_logprobs[0]["logprob"] is None and got.breakdown["reason"].startswith("prompt_logprobs")
    for kind in ("completions", "chat"):
        answers = []
        for client in (via, direct):
            if kind == "completions":
                r = client.completions.create(model="llama", prompt="Answer: yes", max_tokens=2, temperature=0.0,
                                              extra_body={"prompt_logprobs": 1})
                answers.append(r.choices[0].model_extra["prompt_logprobs"])
            else:
                r = client.chat.completions.create(model="llama", messages=ASK, max_tokens=2, temperature=0.0,
                                                   extra_body={"prompt_logprobs": 1})
                answers.append(r.model_extra["prompt_logprobs"])
        assert answers[0] == answers[1] and answers[0][0] is None and len(answers[0]) > 2, kind
    no_leaks(workers)


@pytest.mark.parametrize("kw", SAMPLED, ids=lambda kw: f"t{kw['temperature']}-s{kw.get('seed')}")
def test_sdk_parse_through_the_gateway(sdks, kw):
    outs = [sdk.chat.completions.parse(model="llama", messages=ASK, response_format=Item, max_tokens=200,
                                       extra_body={"guided_decoding_backend": "xgrammar:disable-any-whitespace"},
                                       **kw).choices[0] for sdk in sdks]
    got, want = outs
    assert got.finish_reason == "stop" and isinstance(got.message.parsed, Item), got.message.content
    assert got.message.content == want.message.content and got.message.parsed == want.message.parsed


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("kw", SAMPLED, ids=lambda kw: f"t{kw['temperature']}-s{kw.get('seed')}")
def test_tool_choice_required_through_the_gateway(sdks, kw):
    """The calls' grammar is made at the gateway and enforced on the worker: every call validates,
    and they are the calls a worker called directly returns."""
    outs = [sdk.chat.completions.create(model="llama", messages=ASK, tools=[WEATHER, PING], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, **kw).choices[0] for sdk in sdks]
    got, want = outs
    assert got.finish_reason == "tool_calls" and got.message.content is None, got
    assert valid_calls(got.message.tool_calls) == valid_calls(want.message.tool_calls) and \
        len(got.message.tool_calls) == 1
    named = sdks[0].chat.completions.create(model="llama", messages=ASK, tools=[WEATHER, PING], max_tokens=200,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            **kw).choices[0]
    assert [n for n, _ in valid_calls(named.message.tool_calls)] == ["get_weather"]


def test_auto_and_reasoning_follow_the_gateways_own_flags(cluster, sdks):
    """tool_choice auto and the reasoning parser are the gateway's settings: its workers, started
    without them, refuse auto themselves; through the gateway the hermes parser finds the call
    (the output forced into one by a regex) and qwen3's parser splits off the reasoning."""
    via, direct = sdks
    regex = r'<think>[a-z]{3,6}</think>Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": ' \
            r'"[a-z]{1,8}", "unit": "celsius"\}\}</tool_call>'
    kw = dict(model="llama", messages=ASK, tools=[WEATHER, PING], max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    with pytest.raises(openai.BadRequestError) as info:
        direct.chat.completions.create(**kw)
    assert info.value.param == "tools"  # auto by default, and the worker has no --enable-auto-tool-choice
    got = via.chat.completions.create(**kw).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Ok. "
    assert 3 <= len((got.message.model_extra or {})["reasoning_content"]) <= 6
    assert [n for n, _ in valid_calls(got.message.tool_calls)] == ["get_weather"]


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"guided_regex": "("}), "guided_regex"),
    (dict(tools=[PING, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools[1].function.parameters"),
])
def test_a_bad_schema_is_400_naming_the_field_at_the_gateway(cluster, sdks, kw, param):
    _, gw = cluster
    before = routed(gw)
    with pytest.raises(openai.BadRequestError) as info:
        sdks[0].chat.completions.create(model="llama", messages=ASK, max_tokens=8, **kw)
    assert info.value.status_code == 400 and info.value.param == param
    assert routed(gw) == before


# -- a constrained stream whose worker dies (last: it stops a worker's gRPC server) ----------------
def test_a_constrained_stream_whose_worker_dies_resumes_token_exact(cluster):
    """Constrained streams on one worker, its gRPC server stopped once each has streamed a few
    tokens: each completes through the gateway with the tokens of an undisturbed run, moved once,
    and its output still follows its grammar (the next worker's matcher took the resumed tokens)."""
    workers, gw = cluster
    tok = gw.gateway.frontend.checker.tokenizer
    long_regex = "[a-z]{700,900}"  # 40 tokens cannot reach 700 letters: these run to length
    words = {"json": WORDS, "disable_any_whitespace": True}
    cases = [(f"Write {i}:", so, max_tokens, sampling)
             for i, (so, max_tokens) in enumerate([({"regex": long_regex}, 40), (words, 300)] * 2)
             for sampling in SAMPLED]

    def holds(so, text, finish):
        if "regex" in so:
            return finish == "length" and re.fullmatch("[a-z]+", text)
        jsonschema.validate(json.loads(text), WORDS)
        return finish == "stop"

    async def run_all(kill=None):
        started = [asyncio.Event() for _ in cases]

        async def one(c, i):
            prompt, so, max_tokens, sampling = cases[i]
            toks, text, finish, b = [], "", None, None
            async for msg in c.stream(prompt, max_tokens=max_tokens, structured_outputs=so, **sampling):
                toks += msg.token_ids
                text += msg.text
                finish = msg.finish_reason or finish
                if len(toks) >= 3:
                    started[i].set()
                if msg.HasField("breakdown"):
                    b = msg.breakdown
            started[i].set()
            return toks, text, finish, b

        async with AsyncClient(gw.gateway.grpc_address) as c:
            tasks = [asyncio.ensure_future(one(c, i)) for i in range(len(cases))]
            if kill is not None:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    doomed, survivor = workers[1], gw.gateway.backends.workers["decode-0"]
    survivor.avoid_until = float("inf")  # every stream on the doomed worker, both runs
    try:
        undisturbed = asyncio.run(run_all())
    finally:
        survivor.avoid_until = 0.0
    for (prompt, so, _, _), (toks, text, finish, b) in zip(cases, undisturbed):
        assert holds(so, text, finish), (so, text, finish)
        assert text == tok.decode(toks) and b.migrations == 0 and b.worker_id == "decode-1"

    def kill():
        survivor.avoid_until = 0.0
        asyncio.run_coroutine_threadsafe(doomed.worker.grpc.server.stop(0), doomed.loop).result(10)

    survivor.avoid_until = float("inf")
    try:
        moved = asyncio.run(run_all(kill))
    finally:
        survivor.avoid_until = 0.0
    for (_, so, max_tokens, _), want, (toks, text, finish, b) in zip(cases, undisturbed, moved):
        assert (toks, finish) == (want[0], want[2]), so
        assert text == want[1] and holds(so, text, finish)
        assert b.migrations == 1 and b.worker_id == "decode-0" and b.completion_tokens == len(toks)
    no_leaks(workers[:1])
