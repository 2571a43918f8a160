"""Structured outputs and vLLM's sampling controls on a live decode worker, through its APIs:
the official OpenAI SDK unchanged (``parse`` with a pydantic model, ``response_format``),
vLLM's ``structured_outputs`` and older ``guided_*`` fields, and gRPC's ``StructuredOutputs``.

The model has random weights: a grammar whose sentences are bounded (strings with maxLength,
lists with maxItems, no free numbers) must close within max_tokens whatever it samples; an
unbounded one (any JSON object) may be cut by max_tokens, and then only its prefix is checked.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import grpc
import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from pdserve.api import Client

CHAT = [{"role": "user", "content": "Describe one item of the shop as JSON."}]
SAMPLED = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": s} for s in (1, 2, 3)]


class Item(BaseModel):
    """What `parse` must return: every string and list bounded, so any path through the
    grammar ends within max_tokens."""

    name: str = Field(max_length=10)
    color: Literal["red", "green", "blue"]
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=3)
    in_stock: bool


@pytest.fixture(scope="module")
def sdk(worker):
    with OpenAI(base_url=f"{worker.http}/v1", api_key="not-used", max_retries=0, timeout=120) as client:
        yield client


def post(worker, path, body):
    return httpx.post(f"{worker.http}{path}", json=body, timeout=120)


def completion(worker, extra, prompt="Answer:", **kw):
    r = post(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 48, "temperature": 0, **kw, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# -- constrained output -------------------------------------------------------------------
@pytest.mark.parametrize("kw", SAMPLED, ids=lambda kw: f"t{kw['temperature']}-s{kw.get('seed')}")
def test_sdk_parse_returns_the_pydantic_model(sdk, kw):
    # xgrammar:disable-any-whitespace (vLLM's spelling): JSON without free whitespace, which a
    # random model could otherwise repeat until max_tokens.
    out = sdk.chat.completions.parse(model="llama", messages=CHAT, response_format=Item, max_tokens=200,
                                     extra_body={"guided_decoding_backend": "xgrammar:disable-any-whitespace"}, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Item)
    assert Item.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_is_json_or_its_prefix_cut_by_max_tokens(sdk):
    outs = [sdk.chat.completions.create(model="llama", messages=CHAT, response_format={"type": "json_object"},
                                        max_tokens=64, **kw).choices[0] for kw in SAMPLED]
    for c in outs:
        text = c.message.content
        assert text.lstrip().startswith("{"), text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert c.finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_json_schema_binds_both_routes(worker, path):
    schema = Item.model_json_schema()
    base = {"prompt": "Item:"} if path == "/v1/completions" else {"messages": CHAT}
    r = post(worker, path, {**base, "max_tokens": 200, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "Item", "schema": schema, "strict": True}},
        "structured_outputs": None, "guided_decoding_backend": "xgrammar:disable-any-whitespace"})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    text = c["text"] if path == "/v1/completions" else c["message"]["content"]
    assert c["finish_reason"] == "stop" and Item.model_validate_json(text)


@pytest.mark.parametrize("extra, holds", [
    ({"guided_regex": r"(yes|no)-[0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no)-[0-9]{2}", t)),
    ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_grammar": 'root ::= "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ({"structured_outputs": {"grammar": 'root ::= "ab" ("c" | "d")'}}, lambda t: t in ("abc", "abd")),
    ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: re.fullmatch("[a-c]{3}", t)),
    ({"guided_json": json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
      "guided_decoding_backend": "xgrammar:disable-any-whitespace"}, lambda t: json.loads(t) in ({"ok": True},
                                                                                                  {"ok": False})),
], ids=["guided_regex", "guided_choice", "guided_grammar", "so.grammar", "so.regex", "guided_json"])
def test_vllm_fields_through_extra_body(sdk, extra, holds):
    for kw in SAMPLED:
        out = sdk.completions.create(model="llama", prompt="Answer:", max_tokens=48, extra_body=extra, **kw)
        c = out.choices[0]
        assert c.finish_reason == "stop" and holds(c.text), (kw, c.text)
    chat = sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=48, temperature=0, extra_body=extra)
    assert holds(chat.choices[0].message.content), chat.choices[0].message.content


def test_streamed_chunks_reassemble_the_whole_answer(sdk):
    kw = dict(model="llama", messages=CHAT, max_tokens=200, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "Item", "schema": Item.model_json_schema()}},
        extra_body={"guided_decoding_backend": "xgrammar:disable-any-whitespace"})
    whole = sdk.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in sdk.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole and Item.model_validate_json(whole)


def test_sampling_controls_reach_the_sampler(worker):
    c = completion(worker, {"logit_bias": {"1000": 100}, "ignore_eos": True}, max_tokens=4)
    assert c["token_ids"] == [1000] * 4
    c = completion(worker, {"allowed_token_ids": [7, 8], "ignore_eos": True}, max_tokens=6, temperature=1.0, seed=3)
    assert set(c["token_ids"]) <= {7, 8}
    free = completion(worker, {"ignore_eos": True}, max_tokens=6)
    banned = completion(worker, {"logit_bias": {str(free["token_ids"][0]): -100}, "ignore_eos": True}, max_tokens=6)
    assert banned["token_ids"][0] != free["token_ids"][0]
    c = completion(worker, {"min_p": 1.0, "min_tokens": 3, "bad_words": ["zebra"]}, max_tokens=5, temperature=1.0,
                   seed=1)  # min_p 1: only the most likely token survives, so sampling is greedy
    assert c["token_ids"] == completion(worker, {"min_tokens": 3}, max_tokens=5)["token_ids"]


# -- gRPC ---------------------------------------------------------------------------------
@pytest.mark.parametrize("so, holds", [
    ({"regex": r"(yes|no)-[0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no)-[0-9]{2}", t)),
    ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"grammar": 'root ::= "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ({"json": Item.model_json_schema(), "disable_any_whitespace": True}, Item.model_validate_json),
], ids=["regex", "choice", "grammar", "json"])
def test_grpc_structured_outputs(worker, so, holds):
    with Client(worker.grpc) as c:
        for kw in SAMPLED:
            out = c.generate("Answer:", max_tokens=200, structured_outputs=so, **kw)
            assert out.finish_reason == "stop" and holds(out.text), (kw, out.text)


def test_grpc_sampling_controls_and_the_http_answer_agree(worker):
    with Client(worker.grpc) as c:
        out = c.generate("Answer:", max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={1000: 100.0})
        assert out.token_ids == [1000] * 4
        out = c.generate("Answer:", max_tokens=48, temperature=0.0, structured_outputs={"regex": "[a-c]{3}"},
                         min_p=0.5, min_tokens=1, bad_words=["zebra"], allowed_token_ids=list(range(32000)))
    assert out.text == completion(worker, {"guided_regex": "[a-c]{3}", "min_p": 0.5, "min_tokens": 1,
                                           "bad_words": ["zebra"]})["text"]


@pytest.mark.parametrize("so, field", [
    ({"regex": "("}, "structured_outputs.regex"),
    ({"json": '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_grpc_bad_grammar_is_invalid_argument_naming_it(worker, so, field):
    with Client(worker.grpc) as c, pytest.raises(grpc.RpcError) as info:
        c.generate("Answer:", max_tokens=4, structured_outputs=so)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(f"{field}:")


def test_grpc_bad_sampling_controls_are_invalid_argument_naming_them(worker):
    vocab = worker.worker.engine.model_config.vocab_size
    for kw, field in (({"logit_bias": {vocab: 1.0}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
                      ({"min_p": 1.5}, "min_p"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                      ({"allowed_token_ids": [vocab]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
                      ({"prompt_logprobs": 21}, "prompt_logprobs")):
        with Client(worker.grpc) as c, pytest.raises(grpc.RpcError) as info:
            c.generate("Answer:", **{"max_tokens": 4, **kw})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(f"{field}:")


# -- refusals (HTTP 400 naming the field) ---------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": BAD_SCHEMA}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_decoding_backend": "outlinez"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": "[ ]?", "guided_json": {"type": "object"}}, "guided_whitespace_pattern"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2.5}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": "zebra"}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "1"}, "prompt_logprobs"),
]


@pytest.mark.parametrize("extra, param", REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_structured_and_sampling_fields_are_400_naming_them(worker, path, extra, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    r = post(worker, path, {**base, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_sdk_raises_bad_request_naming_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}})
    assert info.value.status_code == 400 and info.value.param == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="llama", prompt="hi", max_tokens=4, logit_bias={"5": 200})
    assert info.value.param == "logit_bias"


def test_min_tokens_above_max_tokens_means_all_of_them(worker):
    """The schema cannot compare two fields: min_tokens over max_tokens asks for every token
    max_tokens allows, which is what it gets (and the chat default fills the context)."""
    c = completion(worker, {"min_tokens": 40}, max_tokens=5)
    assert len(c["token_ids"]) == 5
    r = post(worker, "/v1/chat/completions", {"messages": CHAT, "min_tokens": 30, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 30


def test_openapi_states_the_new_fields_and_their_bounds(worker):
    doc = httpx.get(f"{worker.http}/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "guided_decoding_backend", "min_p", "min_tokens", "logit_bias",
                 "allowed_token_ids", "bad_words"):
        assert name in props and name in schemas["ChatRequest"]["properties"], name
    bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
    vocab = worker.worker.engine.model_config.vocab_size
    key = re.compile(bias["propertyNames"]["pattern"])
    assert key.match(str(vocab - 1)) and not key.match(str(vocab)) and not key.match("01")
    assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
