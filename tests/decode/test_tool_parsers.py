"""The tool-call and reasoning parsers of chat output (api/tool_parsers.py, api/tool_stream.py,
api/tool_json.py, api/reasoning.py) and the request side of tool calling (api/tool_calls.py),
without a worker: every parser whole and incrementally (the streamed pieces, joined by call index,
are the whole parse, however the text is cut), content around calls, malformed output as content
and never an exception, and the tools' checks and grammars."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pdserve.api.ingress import RequestError
from pdserve.api.openai_types import request_models
from pdserve.api.reasoning import ReasoningParser
from pdserve.api.reference import REFERENCE
from pdserve.api.tool_calls import AUTO_NEEDS_FLAGS, ChatOptions, plan_tools, template_messages
from pdserve.api.tool_parsers import PARSERS, HermesParser, Llama3JsonParser, MistralParser
from pdserve.api.tool_stream import NamedCall, RequiredCalls, parse_whole


def streamed(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed ``text`` cut at ``cuts``; the content and the calls (id, name, arguments) the deltas
    make when joined by index, OpenAI's way. A call's first delta must carry id, type and name."""
    deltas = []
    last = 0
    for cut in [*cuts, len(text)]:
        deltas.append(parser.feed(text[last:cut]))
        last = cut
    deltas.append(parser.finish())
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for entry in d.tool_calls():
            i = entry["index"]
            if i not in calls:
                assert entry["type"] == "function" and entry["id"] and entry["function"]["name"], entry
                calls[i] = [entry["id"], entry["function"]["name"], ""]
            else:
                assert "id" not in entry and "name" not in entry["function"], entry
            calls[i][2] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


def cut_ways(text: str, seed: int = 0) -> list[list[int]]:
    """One piece; every character alone; random pieces of 1-6 characters (three ways)."""
    rnd = random.Random(seed)
    ways = [[], list(range(1, len(text)))]
    for _ in range(3):
        cuts, at = [], 0
        while True:
            at += rnd.randint(1, 6)
            if at >= len(text):
                break
            cuts.append(at)
        ways.append(cuts)
    return ways


WELL_FORMED = [
    # (parser, output, content, [(name, arguments)])
    (HermesParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                   '</tool_call>', None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (HermesParser, 'Let me look.\n<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "}]\\"{"}], "c": null}}'
                   '</tool_call>\n<tool_call>{"arguments": {}, "name": "g"}</tool_call> Done.',
     "Let me look.\n\n Done.", [("f", '{"a": [1, {"b": "}]\\"{"}], "c": null}'), ("g", "{}")]),
    (HermesParser, 'x <tool_call>{"name": "f", "arguments": {"u": "\\u00e9<tool_call>"}}', "x ",
     [("f", '{"u": "\\u00e9<tool_call>"}')]),  # a last block without its end tag
    (HermesParser, '<tool_call>{"name": "only_name"}</tool_call>', None, [("only_name", "{}")]),
    (HermesParser, 'a < b and <tool_ca are not tags', "a < b and <tool_ca are not tags", []),
    (Llama3JsonParser, '{"name": "f", "parameters": {"x": 1.5e-3, "y": true}}', None,
     [("f", '{"x": 1.5e-3, "y": true}')]),
    (Llama3JsonParser, '  <|python_tag|>{"type": "function", "name": "f", "parameters": {}}; '
                       '{"name": "g", "arguments": {"k": "v"}}', None, [("f", "{}"), ("g", '{"k": "v"}')]),
    (Llama3JsonParser, "Plain answer, no call.", "Plain answer, no call.", []),
    (MistralParser, 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": '
                    '{"b": [2]}}]', "Sure. ", [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {}}] and after', " and after", [("f", "{}")]),
]


@pytest.mark.parametrize("make, text, content, calls", WELL_FORMED, ids=[f"{m.__name__}-{i}" for i, (m, *_)
                                                                          in enumerate(WELL_FORMED)])
def test_a_whole_parse_and_every_stream_of_it_agree(make, text, content, calls):
    got_content, got_calls = parse_whole(make(), text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)
    for cuts in cut_ways(text):
        s_content, s_calls = streamed(make(), text, cuts)
        assert [(n, a) for _, n, a in s_calls] == calls, cuts
        assert s_content == (content or "") or (content is None and not s_content.strip()), cuts


def test_ids_are_vllms_forms():
    _, calls = parse_whole(HermesParser(), '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2)
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == 14 + 32 for c in calls)
    assert calls[0].id != calls[1].id
    _, calls = parse_whole(MistralParser(), '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


MALFORMED = [
    (HermesParser, 'text <tool_call>{"name": broken}</tool_call> more'),
    (HermesParser, 'text <tool_call>{"name": "f", "arguments": {"a": 1'),  # cut short
    (HermesParser, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>'),
    (HermesParser, '<tool_call>["f"]</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>'),  # invalid arguments
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}} trailing words'),
    (Llama3JsonParser, '{"name": 5}'),
    (Llama3JsonParser, '{"name": "f", "parameters": {'),
    (MistralParser, 'x [TOOL_CALLS] {"name": "f"}'),
    (MistralParser, 'x [TOOL_CALLS] [{"name": "f", "arguments": {}},]'),
    (MistralParser, '[TOOL_CALLS] [{"name": "f", "arguments": {}}'),
]


@pytest.mark.parametrize("make, text", MALFORMED, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(MALFORMED)])
def test_malformed_output_is_content(make, text):
    assert parse_whole(make(), text) == (text, [])
    for cuts in cut_ways(text):
        streamed(make(), text, cuts)  # no exception, and well-formed deltas


def test_no_output_is_a_crash_fuzzed():
    """Random mixes of the formats' pieces: every parser, whole and streamed, answers."""
    pieces = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":",
              ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"f"', "1", "true", "x", "é", "<", "<tool"]
    rnd = random.Random(57)
    for _ in range(400):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 30)))
        for make in (*PARSERS.values(), RequiredCalls):
            content, calls = parse_whole(make(), text)
            assert (content, calls) == (text, []) or all(json.loads(c.arguments) is not None for c in calls)
            streamed(make(), text, cut_ways(text, rnd.randint(0, 99))[rnd.randint(0, 4)])


def test_required_and_named_outputs():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": ["x"]}}]'
    content, calls = parse_whole(RequiredCalls(), text, keep_partial=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": ["x"]}')]
    for cuts in cut_ways(text):
        s_content, s_calls = streamed(RequiredCalls(), text, cuts)
        assert s_content == "" and [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]
    assert [c.name for c in parse_whole(RequiredCalls(max_calls=1), text, keep_partial=True)[1]] == ["f"]
    # cut short by max_tokens: the calls as far as they got (finish_reason says length)
    assert [(c.name, c.arguments) for c in parse_whole(RequiredCalls(), text[:text.index("}")], keep_partial=True)[1]] == \
        [("f", '{"a": 1')]
    content, calls = parse_whole(NamedCall("f"), '{"a": 1}', keep_partial=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert streamed(NamedCall("f"), '{"a": 1}', [1, 3])[1][0][1:] == ("f", '{"a": 1}')


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_whole(HermesParser(max_calls=1), text)[1]] == ["f"]
    assert [n for _, n, _ in streamed(HermesParser(max_calls=1), text, [5, 50, 60])[1]] == ["f"]


# -- reasoning ---------------------------------------------------------------------------------
REASONING = [
    ("deepseek_r1", "<think>Let me think.</think>The answer.", "Let me think.", "The answer."),
    ("deepseek_r1", "Thinking without the open tag</think>\n\nAnswer", "Thinking without the open tag", "\n\nAnswer"),
    ("deepseek_r1", "never closed", "never closed", None),
    ("deepseek_r1", "<thinkish> text", "<thinkish> text", None),
    ("qwen3", "\n<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "\n\nYes."),
    ("qwen3", "No thinking here </think> at all", None, "No thinking here </think> at all"),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "<thi", None, "<thi"),
]


@pytest.mark.parametrize("name, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    assert ReasoningParser(name).whole(text) == (reasoning, content)
    for cuts in cut_ways(text):
        p, r, c, last = ReasoningParser(name), "", "", 0
        for cut in [*cuts, len(text)]:
            dr, dc = p.feed(text[last:cut])
            r, c, last = r + dr, c + dc, cut
        dr, dc = p.finish()
        assert (r + dr or None, c + dc or None) == (reasoning, content), cuts


# -- the request side --------------------------------------------------------------------------
ChatRequest = request_models(REFERENCE).chat
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
AUTO = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat(**kw):
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def refused(body, options=ChatOptions()) -> RequestError:
    with pytest.raises(RequestError) as err:
        plan_tools(body, options)
    return err.value


def test_tool_choice_modes():
    assert plan_tools(chat(), ChatOptions()).mode == "none"
    assert plan_tools(chat(tools=[], tool_choice="none"), ChatOptions()).mode == "none"
    none = plan_tools(chat(tools=[WEATHER], tool_choice="none"), ChatOptions())
    assert none.mode == "none" and none.tools == [WEATHER] and none.structured_outputs is None  # still shown
    assert plan_tools(chat(tools=[WEATHER]), AUTO).mode == "auto"  # vLLM's default with tools
    assert plan_tools(chat(tools=[], tool_choice="required"), ChatOptions()).mode == "none"  # vLLM's rule
    named = plan_tools(chat(tools=[NOARGS, WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), ChatOptions())
    assert named.mode == "named" and named.name == "get_weather"
    assert named.structured_outputs == {"json": WEATHER["function"]["parameters"], "disable_any_whitespace": True}
    assert named.renames["structured_outputs.json"] == "tools[1].function.parameters"


def test_the_required_grammar_is_vllms_array_of_calls():
    plan = plan_tools(chat(tools=[WEATHER, NOARGS], tool_choice="required"), ChatOptions())
    schema = plan.structured_outputs["json"]
    assert plan.structured_outputs["disable_any_whitespace"] is True and "maxItems" not in schema
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Oslo"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(chat(tools=[WEATHER, NOARGS], tool_choice="required", parallel_tool_calls=False),
                        ChatOptions()).structured_outputs["json"]
    assert single["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)


def test_defs_are_lifted_to_the_top_and_a_clash_is_refused():
    item = {"type": "object", "properties": {"q": {"type": "string"}}}
    with_defs = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"it": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}}}}
    schema = plan_tools(chat(tools=[with_defs], tool_choice="required"), ChatOptions()).structured_outputs["json"]
    assert schema["$defs"] == {"Item": item}
    jsonschema.validate([{"name": "f", "parameters": {"it": {"q": "x"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"it": {"q": 1}}}], schema)
    other = json.loads(json.dumps(with_defs).replace('"f"', '"g"').replace('"string"', '"integer"'))
    assert refused(chat(tools=[with_defs, other], tool_choice="required")).field == "tools[1].function.parameters"


def test_tool_refusals_name_the_field():
    assert refused(chat(tools=[WEATHER, WEATHER])).field == "tools[1].function.name"
    err = refused(chat(tools=[WEATHER], tool_choice="auto"))
    assert err.field == "tool_choice" and AUTO_NEEDS_FLAGS in str(err)
    err = refused(chat(tools=[WEATHER]))  # auto by default
    assert err.field == "tools" and AUTO_NEEDS_FLAGS in str(err)
    assert refused(chat(tool_choice="required")).field == "tool_choice"
    assert refused(chat(tool_choice="auto"), AUTO).field == "tool_choice"
    assert refused(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "other"}})
                   ).field == "tool_choice"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ChatOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatOptions(reasoning_parser="nope")


def test_history_messages_for_the_template():
    body = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"}])
    assert template_messages(body.messages) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "c1"}]

    def field_of(messages) -> str:
        with pytest.raises(RequestError) as err:
            template_messages(chat(messages=messages).messages)
        return err.value.field

    assert field_of([{"role": "tool", "content": "x"}]) == "messages[0].tool_call_id"
    assert field_of([{"role": "user"}]) == "messages[0].content"
    assert field_of([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]) == \
        "messages[1].tool_calls[0].function.arguments"
    assert field_of([{"role": "user", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]) == "messages[0].tool_calls"


def test_a_choice_with_reasoning_content_and_calls():
    """The reply's reader: reasoning first, then the calls' parser over the rest; the stream's
    deltas joined are the whole message, and finish_reason says tool_calls."""
    plan = plan_tools(chat(tools=[WEATHER]), ChatOptions(True, "hermes", "qwen3"))
    make = plan.shaper(ChatOptions(True, "hermes", "qwen3"))
    text = ('<think>user wants weather</think>Checking. <tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "celsius"}}</tool_call>')
    whole = make()
    msg = whole.message(text)
    assert msg["reasoning_content"] == "user wants weather" and msg["content"] == "Checking. "
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo", "unit": "celsius"}')]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for cuts in cut_ways(text, 3):
        s, joined, last = make(), {"reasoning_content": "", "content": "", "arguments": ""}, 0
        bounds = [*cuts, len(text)]
        for k, cut in enumerate(bounds):
            d = s.feed(text[last:cut], final=k == len(bounds) - 1)
            last = cut
            joined["reasoning_content"] += d.get("reasoning_content", "")
            joined["content"] += d.get("content", "")
            joined["arguments"] += "".join(c["function"]["arguments"] for c in d.get("tool_calls", []))
        assert joined == {"reasoning_content": "user wants weather", "content": "Checking. ",
                          "arguments": '{"city": "Oslo", "unit": "celsius"}'}
        assert s.finish_reason("stop") == "tool_calls"
    plain = plan_tools(chat(), ChatOptions())
    assert plain.shaper(ChatOptions()) is None  # no tools, no reasoning parser: the reply is as it was
    msg = plain.shaper(ChatOptions(reasoning_parser="deepseek_r1"))().message("all thought")
    assert msg == {"role": "assistant", "reasoning_content": "all thought", "content": None}


def test_the_topology_and_cli_pass_the_flags_to_the_worker(tmp_path):
    """roles.decode's keys (vLLM's flag names) reach the decode worker's config; a bad parser
    name is refused when the worker builds its options, naming the setting."""
    from pdserve.cli import build_parser
    from pdserve.cluster.topology import load_topology
    from pdserve.cluster.worker_config import launch_config
    from pdserve.decode.worker import DecodeWorkerConfig

    (tmp_path / "t.yaml").write_text("cluster: c\nmodel:\n  path: auto\nroles:\n  prefill:\n    replicas: 0\n"
                                     "  decode:\n    replicas: 1\n    enable_auto_tool_choice: true\n"
                                     "    tool_call_parser: mistral\n    reasoning_parser: deepseek_r1\n")
    cfg = DecodeWorkerConfig.of(launch_config(load_topology(tmp_path / "t.yaml"), "decode", 0, model="/m",
                                              etcd_endpoints=[]))
    assert cfg.chat_options() == ChatOptions(True, "mistral", "deepseek_r1")
    with pytest.raises(ValueError, match="tool_call_parser: 'qwen'"):
        DecodeWorkerConfig(model="/m", tool_call_parser="qwen").chat_options()
    args = build_parser().parse_args(["serve-decode", "--model", "/m", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (True, "llama3_json", "qwen3")
