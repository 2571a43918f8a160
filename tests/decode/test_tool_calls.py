"""Tool calling and reasoning on a live decode worker, with the official `openai` SDK: a random
model under tool_choice "required" or a named function always returns calls whose arguments
follow the tool's schema (the grammar makes it: the schemas are bounded, so any path closes);
streamed calls reassemble by index to the whole answer; tool messages and assistant tool calls
in the history render through the template; the refusals name their field. The worker reads
free output with the hermes parser and qwen3's reasoning parser (forced outputs exercise them)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from pdserve.api.http_app import build_app
from pdserve.api.tool_calls import AUTO_NEEDS_FLAGS
from pdserve.decode.worker import DecodeWorkerConfig
from tests.harness import PERMISSIVE_POLICY, WorkerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,10}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SHOPPING = {"type": "function", "function": {
    "name": "add_items",
    "parameters": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {"enum": ["milk", "eggs", "bread"]}},
        "count": {"type": "integer", "minimum": 1, "maximum": 20},
        "urgent": {"type": "boolean"}},
        "required": ["items", "count", "urgent"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: called with {}
TOOLS = [WEATHER, SHOPPING, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo? Also buy milk."}]
SAMPLING = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2),
            dict(temperature=1.5, seed=3)]


@pytest.fixture(scope="module")
def tool_worker(llama_dir, tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 1024}, router_policy=str(policy),
                             enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    w = WorkerThread(cfg).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def sdk(tool_worker):
    with OpenAI(base_url=f"{tool_worker.http}/v1", api_key="not-used", max_retries=0, timeout=120) as client:
        yield client


def valid_calls(calls) -> list[tuple[str, dict]]:
    """Each call's name and arguments, checked against its tool's schema."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


@pytest.mark.parametrize("sampling", SAMPLING, ids=lambda s: f"t{s['temperature']}-s{s.get('seed')}")
def test_required_always_returns_valid_calls(sdk, sampling):
    """parallel_tool_calls false: one call, and its schema is bounded, so the output always ends."""
    out = sdk.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=200, **sampling)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(valid_calls(choice.message.tool_calls)) == 1


def test_required_parallel_calls_are_each_valid(sdk):
    """Several calls: the array has no bound (vLLM's schema), so a random model may fill max_tokens
    with calls; every finished one is valid, and only a call cut short by length may not be."""
    for sampling in SAMPLING[:2]:
        choice = sdk.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, **sampling).choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason in ("tool_calls", "length") and calls
        valid_calls(calls if choice.finish_reason == "tool_calls" else calls[:-1])


@pytest.mark.parametrize("name", ["get_weather", "add_items", "ping"])
def test_a_named_function_is_always_called_validly(sdk, name):
    for sampling in SAMPLING[:3]:
        out = sdk.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, max_tokens=200, **sampling,
                                          tool_choice={"type": "function", "function": {"name": name}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [n for n, _ in valid_calls(choice.message.tool_calls)] == [name]


def reassembled(stream) -> tuple[str | None, list[tuple[str, str, str]], str | None, str | None]:
    """A stream's content, calls (id, name, arguments joined by index), finish reason, reasoning."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, tc  # a call's first delta names it
                calls[tc.index] = [tc.id, tc.function.name, ""]
            calls[tc.index][2] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish, reasoning or None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add_items"}}],
                         ids=["required", "named"])
def test_streamed_calls_reassemble_to_the_whole_answer(sdk, tool_choice):
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=7)):
        kw = dict(model="llama", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                  parallel_tool_calls=False, **sampling)
        whole = sdk.chat.completions.create(**kw).choices[0]
        content, calls, finish, _ = reassembled(sdk.chat.completions.create(**kw, stream=True))
        assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                                 for c in whole.message.tool_calls]
        assert finish == whole.finish_reason == "tool_calls" and not content
    # several calls, cut short by max_tokens: the stream still gives what the whole answer gives
    kw = dict(model="llama", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=60, temperature=0)
    whole = sdk.chat.completions.create(**kw).choices[0]
    content, calls, finish, _ = reassembled(sdk.chat.completions.create(**kw, stream=True))
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason


def forced(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def test_auto_reads_free_output_with_the_hermes_parser(sdk):
    """The output is forced (a regex) into a hermes call after some text: the parser finds it."""
    regex = r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "unit": "celsius"\}\}' \
            r'</tool_call>'
    kw = dict(model="llama", messages=ASK, tools=TOOLS, max_tokens=100, temperature=0, extra_body=forced(regex))
    whole = sdk.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Ok. "
    assert [n for n, _ in valid_calls(whole.message.tool_calls)] == ["get_weather"]
    content, calls, finish, _ = reassembled(sdk.chat.completions.create(**kw, stream=True))
    assert content == "Ok. " and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # free text without a call stays content, finish_reason as generated
    plain = sdk.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, max_tokens=5, temperature=0,
                                        extra_body=forced("[a-z]{5}")).choices[0]
    assert plain.message.tool_calls is None and len(plain.message.content) == 5


def test_reasoning_goes_to_reasoning_content(sdk):
    kw = dict(model="llama", messages=ASK, max_tokens=60, temperature=0,
              extra_body=forced(r"<think>[a-z]{3,6}</think>[a-z]{2,5}"))
    msg = sdk.chat.completions.create(**kw).choices[0].message
    thought, answer = (msg.model_extra or {})["reasoning_content"], msg.content
    assert 3 <= len(thought) <= 6 and 2 <= len(answer) <= 5 and thought.isalpha() and answer.isalpha()
    content, _, _, reasoning = reassembled(sdk.chat.completions.create(**kw, stream=True))
    assert (reasoning, content) == (thought, answer)


def test_tool_history_renders_through_the_template(sdk, tool_worker):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "chatcmpl-tool-1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "12 degrees, rain"}]
    out = sdk.chat.completions.create(model="llama", messages=history, tools=TOOLS, tool_choice="none",
                                      max_tokens=4, temperature=0)
    tok = tool_worker.worker.engine.tokenizer
    rendered = tok.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "oslo", "unit": "celsius"}}}]},
         {"role": "tool", "content": "12 degrees, rain", "tool_call_id": "chatcmpl-tool-1"}], tools=TOOLS)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "oslo"' in rendered
    assert "<tool_response>12 degrees, rain</tool_response>" in rendered and '"name": "add_items"' in rendered
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert out.choices[0].message.tool_calls is None  # none: plain text


def http_error(sdk, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="llama", max_tokens=4, **{"messages": ASK, **kw})
    return err.value


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}], tool_choice="required"),
     "tools[0].function.parameters"),
    (dict(tools=[PING, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          tool_choice="required"), "tools[1].function.parameters"),
    (dict(tools=[PING, {"type": "function", "function": {"name": "bad name!"}}]), "tools[1].function.name"),
    (dict(tools=[PING, PING], tool_choice="required"), "tools[1].function.name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(function_call="auto"), "function_call"),
    (dict(messages=[*ASK, {"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (dict(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
])
def test_refusals_name_the_field(sdk, kw, param):
    assert http_error(sdk, **kw).param == param


def test_auto_without_the_servers_flag_is_vllms_400(tool_worker):
    """A worker started without --enable-auto-tool-choice answers vLLM's 400 (refused before any work)."""
    with TestClient(build_app(tool_worker.worker.frontend)) as client:
        r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "auto"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert AUTO_NEEDS_FLAGS in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})  # auto by default
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_replies_match_the_documented_response_models(tool_worker):
    """The raw JSON (whole and every event) of calls and of reasoning fits the models
    /openapi.json documents (api/openai_responses.py: extra fields are refused there)."""
    import httpx

    from pdserve.api.openai_responses import ChatCompletion, ChatCompletionChunk

    bodies = [{"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0},
              {"messages": ASK, "tools": TOOLS, "max_tokens": 30, "temperature": 0,
               **forced(r"<think>[a-z]{2,4}</think>ok <tool_call>\{\"name\": \"ping\", \"arguments\": \{\}\}"
                        r"</tool_call>")}]
    with httpx.Client(base_url=tool_worker.http, timeout=120) as h:
        for body in bodies:
            whole = h.post("/v1/chat/completions", json=body)
            assert whole.status_code == 200, whole.text
            ChatCompletion.model_validate(whole.json())
            with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                lines = [line[6:] for line in r.iter_lines() if line]
            assert lines[-1] == "[DONE]"
            for line in lines[:-1]:
                ChatCompletionChunk.model_validate(json.loads(line))
