"""The OpenAI-compatible HTTP API on the wire, as vLLM's server answers it: logprobs,
stream_options.include_usage, the role in the first chat delta, echo, prompt lists, n > 1,
one error shape everywhere, strict types, unsupported fields refused by name, and an
OpenAPI document that describes what the server does."""

from __future__ import annotations

import json
import random
import socket

import grpc
import httpx
import pytest

from pdserve.api import Client

from tests.harness import wait_until


def post(worker, path, body, **kw):
    with httpx.Client(base_url=worker.http, timeout=120) as h:
        return h.post(path, json=body, **kw)


def events(worker, path, body) -> list:
    """The data of each server-sent event; the last one must be [DONE]."""
    out = []
    with httpx.Client(base_url=worker.http, timeout=120) as h:
        with h.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line:
                    assert line.startswith("data: ")
                    out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


CHAT = [{"role": "user", "content": "Tell me about disaggregated serving"}]


# -- logprobs ---------------------------------------------------------------------------------
def test_completion_logprobs_have_openai_shape_and_grpc_values(worker):
    prompt = ids(12, seed=1)
    r = post(worker, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and len(top) in (3, 4) and top[tok] == value
        assert value == max(top.values())  # greedy: the sampled token is the most likely one
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    with Client(worker.grpc) as c:
        ref = c.generate(prompt, max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    assert [e["logprob"] for e in ref.logprobs] == pytest.approx(lp["token_logprobs"])
    assert choice["token_ids"] == ref.token_ids


def test_completion_logprobs_stream_equal_the_whole_answer(worker):
    body = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = post(worker, "/v1/completions", body).json()["choices"][0]["logprobs"]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events(worker, "/v1/completions", {**body, "stream": True}):
        for k in streamed:
            streamed[k] += ev["choices"][0]["logprobs"][k]
    assert streamed == whole


def test_chat_logprobs_have_openai_shape(worker):
    r = post(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                              "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["bytes"] == list(e["token"].encode())
        tops = e["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert e["logprob"] == tops[0]["logprob"]  # greedy
    no_top = post(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in no_top.json()["choices"][0]["logprobs"]["content"])
    assert post(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()["choices"][0][
        "logprobs"] is None


def test_top_logprobs_without_logprobs_is_400(worker):
    r = post(worker, "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


# -- streaming ---------------------------------------------------------------------------------
def test_include_usage_sends_a_last_usage_chunk(worker):
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    usage = post(worker, "/v1/completions", body).json()["usage"]
    evs = events(worker, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert evs[-1]["choices"] == [] and evs[-1]["usage"] == usage
    assert all(e["usage"] is None for e in evs[:-1])
    plain = events(worker, "/v1/completions", {**body, "stream": True})
    assert all("usage" not in e for e in plain)


def test_stream_options_without_stream_is_400(worker):
    r = post(worker, "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_chat_stream_first_delta_carries_the_role(worker):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = post(worker, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    evs = events(worker, "/v1/chat/completions", {**body, "stream": True})
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in e["choices"][0]["delta"] for e in evs[1:])
    assert "".join(e["choices"][0]["delta"]["content"] for e in evs) == whole
    assert evs[-1]["choices"][0]["finish_reason"] == "length"


# -- echo, prompt lists, n ---------------------------------------------------------------------
def test_echo_prepends_the_prompt(worker):
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = post(worker, "/v1/completions", {**body, "prompt": "Hello there"}).json()["choices"][0]["text"]
    echoed = post(worker, "/v1/completions", {**body, "prompt": "Hello there", "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Hello there" + plain
    evs = events(worker, "/v1/completions", {**body, "prompt": "Hello there", "echo": True, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in evs) == "Hello there" + plain
    token_prompt = ids(6, seed=3)
    with Client(worker.grpc) as c:
        ref = c.generate(token_prompt, max_tokens=3, temperature=0.0, ignore_eos=True)
    got = post(worker, "/v1/completions", {**body, "prompt": token_prompt, "echo": True}).json()
    text = got["choices"][0]["text"]
    assert text.endswith(ref.text) and len(text) > len(ref.text)


def test_echo_with_logprobs_starts_with_the_prompt_tokens(worker):
    """As vLLM: the legacy logprobs cover the prompt's tokens (the first one null), then the
    generated ones; the answer has the documented shape (api/openai_responses.py)."""
    from pdserve.api.openai_responses import Completion

    prompt = ids(6, seed=3)
    r = post(worker, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2,
                                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = Completion.model_validate(r.json()).choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(prompt) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_prompt_list_gives_one_choice_per_prompt_in_order(worker, as_ids):
    prompts = [ids(n, seed=n) for n in (5, 17, 9)] if as_ids else ["one", "two three", "four five six"]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    singles = [post(worker, "/v1/completions", {**body, "prompt": p}).json() for p in prompts]
    batch = post(worker, "/v1/completions", {**body, "prompt": prompts}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in batch["choices"]] == [s["choices"][0]["token_ids"] for s in singles]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert batch["usage"]["completion_tokens"] == 12
    evs = events(worker, "/v1/completions", {**body, "prompt": prompts, "stream": True})
    streamed = {i: [] for i in range(3)}
    for e in evs:
        (c,) = e["choices"]
        streamed[c["index"]] += c["token_ids"]
    assert [streamed[i] for i in range(3)] == [c["token_ids"] for c in batch["choices"]]


def test_n_samples_share_the_prompt_blocks_and_use_seed_plus_index(worker):
    prompt = ids(40, seed=9)  # two full 16-token blocks and a partial one
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    r = post(worker, "/v1/completions", {**body, "n": 3}).json()
    choices = r["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["pdserve"]["cached_tokens"] for c in choices[1:]] == [32, 32]  # siblings hit sample 0's blocks
    assert r["usage"] == {"prompt_tokens": 40, "completion_tokens": 24, "total_tokens": 64}
    for j, c in enumerate(choices):
        alone = post(worker, "/v1/completions", {**body, "seed": 7 + j}).json()["choices"][0]
        assert c["token_ids"] == alone["token_ids"], j
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    chat = post(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    evs = events(worker, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "stream": True})
    roles = [e["choices"][0]["index"] for e in evs if e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    assert {e["choices"][0]["index"] for e in evs if e["choices"][0]["finish_reason"]} == {0, 1}


def test_refused_sibling_ends_every_sequence(worker):
    """A request whose second prompt is refused is refused whole, and holds no block."""
    r = post(worker, "/v1/completions", {"prompt": [ids(5), [5] * 600], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(worker, "/v1/completions", {"prompt": ["ok", "ok"], "max_tokens": 511, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    eng = worker.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15.0)


# -- chat parameters ---------------------------------------------------------------------------
def test_max_completion_tokens_wins_and_chat_default_fills_the_context(worker):
    body = {"messages": CHAT, "temperature": 0, "ignore_eos": True}
    r = post(worker, "/v1/chat/completions", {**body, "max_tokens": 9, "max_completion_tokens": 3}).json()
    assert r["usage"]["completion_tokens"] == 3
    r = post(worker, "/v1/chat/completions", body).json()
    assert r["usage"]["total_tokens"] == worker.worker.engine.max_model_len  # vLLM's chat default
    assert r["choices"][0]["finish_reason"] == "length"


def test_developer_role_and_text_parts_read_as_system_and_string(worker):
    base = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    a = post(worker, "/v1/chat/completions", {**base, "messages": [
        {"role": "system", "content": "Be brief.\nAlways."}, {"role": "user", "content": "hi"}]}).json()
    b = post(worker, "/v1/chat/completions", {**base, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Always."}]},
        {"role": "user", "content": "hi", "name": "alice"}], "user": "u-1", "seed": 3}).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    r = post(worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content")


UNSUPPORTED = [
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),  # supported; a bias outside [-100, 100] is not
    # tools default to tool_choice auto, which needs --enable-auto-tool-choice (vLLM's 400; test_tool_calls.py)
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),  # a tool_choice needs tools
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
]
NO_OP = [
    ("/v1/completions", {"suffix": None, "best_of": 1, "logit_bias": {}, "user": "u"}),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                              "logit_bias": None, "functions": None}),
]


@pytest.mark.parametrize("path, extra, param", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_openai_fields_are_400_naming_them(worker, path, extra, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    r = post(worker, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, extra", NO_OP)
def test_values_meaning_not_used_are_accepted(worker, path, extra):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    assert post(worker, path, {**base, "max_tokens": 2, **extra}).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "stream": "true"}, "stream"),
    ({"prompt": "hi", "n": "2"}, "n"),
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "echo": 1}, "echo"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_wrong_json_types_are_refused_not_coerced(worker, body, param):
    r = post(worker, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_integral_json_number_is_that_integer(worker):
    """JSON Schema's integer includes 3.0, so the schema and the server agree on it."""
    r = post(worker, "/v1/completions", {"prompt": "hi", "max_tokens": 3.0, "n": 1.0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- one error shape ---------------------------------------------------------------------------
def assert_openai_error(r, status, param="unset", code=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == (status if code is None else code)
    if param != "unset":
        assert err["param"] == param


def test_unknown_model_is_404_naming_model(worker):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        assert_openai_error(post(worker, path, {**body, "model": "gpt-4o"}), 404, "model", "model_not_found")
    with Client(worker.grpc) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate("hi", model="gpt-4o")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details().startswith("model: ")


def test_every_error_has_the_openai_shape(worker):
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        assert_openai_error(h.get("/v1/nothing-here"), 404, None)
        r = h.get("/v1/completions")
        assert_openai_error(r, 405, None)
        assert "POST" in r.headers["allow"]
        assert_openai_error(h.post("/v1/completions", content=b"\xff\xfe", headers={
            "content-type": "application/json"}), 400, "body")
        assert_openai_error(h.post("/v1/completions", content=b"{", headers={
            "content-type": "application/json"}), 400, "body")
        assert_openai_error(h.post("/v1/completions", json={"prompt": "x" * (1 << 24)}), 413, "body")
    host, port = worker.worker.http_address.rsplit(":", 1)
    for raw, status in ((b"NOT HTTP AT ALL\r\n\r\n", 400),
                        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n", 431)):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(raw)
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except ConnectionResetError:  # the server closes with our unread headers still queued
                pass
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status}".encode()) and b"application/json" in head.lower(), head
        assert json.loads(body)["error"]["code"] == status


# -- the OpenAPI document ------------------------------------------------------------------------
def test_openapi_document_describes_the_server(worker):
    doc = httpx.get(f"{worker.http}/openapi.json", timeout=10).json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in doc["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "409", "413", "429", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "404", "413", "429", "500", "503"):
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    r = httpx.get(f"{worker.http}/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain") and "# TYPE" in r.text
    s = doc["components"]["schemas"]
    req = s["CompletionRequest"]["properties"]
    assert {"type": "string", "maxLength": worker.worker.frontend.max_prompt_chars, "minLength": 1} in \
        req["prompt"]["anyOf"]
    eng = worker.worker.engine
    assert req["max_tokens"]["anyOf"][0]["maximum"] == eng.max_model_len - 1
    assert req["seed"]["anyOf"][0]["maximum"] == 2**64 - 1  # exact, not a float
    assert s["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert {"CompletionChunk", "ChatCompletionChunk", "ErrorResponse"} <= set(s)


def test_chat_over_the_context_names_messages(worker):
    long = " ".join(f"word{i}" for i in range(400))
    r = post(worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "max_model_len" in r.json()["error"]["message"]


def test_client_gone_mid_stream_ends_every_sequence(worker):
    """Two prompts x two samples streaming; the client leaves after the first event: every
    sequence is aborted and every block comes back."""
    body = {"prompt": ["a long story", "another one"], "n": 2, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=worker.http, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    eng = worker.worker.engine
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 15.0)


def test_a_worker_without_lora_serves_no_adapter_routes(worker):
    """As vLLM: /v1/load_lora_adapter and /v1/unload_lora_adapter exist only on a worker that
    can load adapters (tests/decode/test_lora_api.py has them); elsewhere they are not routes."""
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert post(worker, path, {"lora_name": "a", "lora_path": "/nowhere"}).status_code == 404
    assert all("lora" not in p for p in httpx.get(f"{worker.http}/openapi.json", timeout=10).json()["paths"])
