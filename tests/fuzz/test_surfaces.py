"""The client-facing surfaces fuzzed against a live decode worker (loopback).

HTTP: schemathesis draws requests from the worker's own OpenAPI document, both
schema-conforming ("positive") and schema-violating ("negative") ones, and runs
every one of its checks on each answer (status codes, content types, response
schemas and headers as documented; valid data accepted, invalid data refused;
unsupported methods answered 405). One check is narrowed: a valid request may
still be refused with 400 when prompt + max_tokens exceed the model's context,
which depends on the tokenized prompt and no JSON schema can express; and a structured-output
constraint (a regex, grammar or JSON schema) may be refused when it does not compile, and a
history's tool call when its arguments (a string to the schema) are not a JSON object, and
the rules on tools and tool_choice the schema does not state (`tool_rule_no_schema_states`). gRPC:
Hypothesis builds GenerateRequest messages with any field values, plus raw bytes.
After each surface: no 5xx / INTERNAL / UNKNOWN, the engine alive, no leaked block.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from pdserve.api.v1 import inference_pb2 as pb
from pdserve.decode.worker import DecodeWorkerConfig

from tests.fuzz.profiles import examples
from tests.harness import PERMISSIVE_POLICY, WorkerThread, wait_until


@pytest.fixture(scope="module")
def worker(llama_dir, tmp_path_factory):
    """A small-context worker so that any valid request is cheap to serve."""
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    cfg = DecodeWorkerConfig(model=llama_dir, engine_args={"max_model_len": 96}, router_policy=str(policy),
                             limits={"max_body_bytes": 65536, "max_n": 2, "max_prompts": 2})
    w = WorkerThread(cfg).start()
    yield w
    w.stop()


def assert_alive_and_clean(worker):
    eng = worker.worker.engine
    assert worker.worker.async_engine.alive
    wait_until(lambda: not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks, 30.0)
    assert httpx.get(f"{worker.http}/health", timeout=10).status_code == 200


# -- HTTP (OpenAPI) ---------------------------------------------------------------------
CONTEXT_PARAMS = {"prompt", "messages", "max_tokens", "max_completion_tokens"}
# Constraints the schema can only call a string (or an object): whether they compile (a regex, a
# grammar, a JSON schema with keywords xgrammar supports) only the compiler knows.
GRAMMAR_PARAMS = {"response_format.json_schema.schema", "guided_json", "guided_regex", "guided_grammar",
                  *(f"structured_outputs.{k}" for k in ("json", "regex", "grammar", "structural_tag"))}
# JSON text the schema can only call a string (its contentSchema is an annotation, checked by no
# validator): the arguments of a call in an assistant message of the history must be a JSON object.
JSON_TEXT_PARAM = re.compile(r"messages\[\d+\]\.tool_calls\[\d+\]\.function\.arguments")


# The rules on a chat request's tools and tool_choice (api/tool_calls.py `plan_tools`): some no JSON
# schema can state (names unique, a named function among the tools; a tool's parameters a JSON
# schema, whose meta-schema is not in the document, that compiles); the others (tool_choice needs
# tools, auto needs the worker's flags, required or a named function with no other constraint)
# would take the request schema's alternatives past what schemathesis' generator models (its
# canonical form, jsonschema_rs 0.60: the operation becomes UnsupportedSchema), so they are not in it.
TOOL_PARAM = re.compile(r"tools\[\d+\]\.function\.(name|parameters)")


def tool_rule_no_schema_states(err: dict, body) -> bool:
    """A refusal by the rules on tools that the schema does not state (TOOL_PARAM's comment), or a
    structured-output field refused beside tool_choice required or a named function."""
    param = err["param"] or ""
    if param in ("tools", "tool_choice") or TOOL_PARAM.fullmatch(param):
        return True
    choice = body.get("tool_choice") if isinstance(body, dict) else None
    return (choice == "required" or isinstance(choice, dict)) and "not with tool_choice" in err["message"]


def positive_data_accepted_within_context(ctx, response, case):
    """schemathesis' positive_data_acceptance, except for the refusals of valid data the
    schema cannot state: a body over the worker's limits.max_body_bytes (413 naming the body),
    the prompt's tokens plus max_tokens over max_model_len (the message says so and names the
    field), a constraint that does not compile (named), logits controls that leave no token to
    generate (named), a tool call's arguments that are not a JSON object (named), the rules on
    tools the schema does not state (`tool_rule_no_schema_states`)."""
    if response.status_code == 413 and response.json()["error"]["param"] == "body":
        return None  # a valid body over limits.max_body_bytes (a size the schema cannot state)
    if response.status_code == 400 and case.meta is not None and case.meta.generation.mode.is_positive:
        err = response.json()["error"]
        if err["param"] in CONTEXT_PARAMS and "max_model_len" in err["message"]:
            return None
        if err["param"] in GRAMMAR_PARAMS or JSON_TEXT_PARAM.fullmatch(err["param"] or ""):
            return None
        if err["param"] in ("allowed_token_ids", "min_tokens") and "nothing can be generated" in err["message"]:
            return None
        if tool_rule_no_schema_states(err, case.body):
            return None
    return positive_data_acceptance(ctx, response, case)


def negative_data_rejected_or_too_large(ctx, response, case):
    """schemathesis' negative_data_rejection, with 413 counted as a rejection: a body over
    limits.max_body_bytes is refused before it is parsed (as the CLI test configures it)."""
    if response.status_code == 413 and response.json()["error"]["param"] == "body":
        return None
    return negative_data_rejection(ctx, response, case)


def all_checks():
    load_all_checks()
    replaced = {positive_data_acceptance, negative_data_rejection}
    return [c for c in CHECKS.get_all() if c not in replaced] + [
        positive_data_accepted_within_context, negative_data_rejected_or_too_large]


OPERATIONS = [("POST", "/v1/completions", m) for m in GenerationMode] + \
    [("POST", "/v1/chat/completions", m) for m in GenerationMode] + \
    [("GET", path, GenerationMode.POSITIVE) for path in ("/v1/models", "/health", "/metrics")]


@pytest.mark.parametrize("method, path, mode", OPERATIONS, ids=lambda x: getattr(x, "value", x))
def test_openapi_surface_passes_every_schemathesis_check(worker, method, path, mode):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{worker.http}/openapi.json", timeout=10).json())
    strategy = schema[path][method].as_strategy(generation_mode=mode)
    statuses: dict[int, int] = {}
    checks = all_checks()

    @settings(max_examples=examples(40 if method == "POST" else 5))
    @given(case=strategy)
    def check(case):
        resp = case.call(base_url=worker.http, timeout=60)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        case.validate_response(resp, checks=checks, transport_kwargs={"base_url": worker.http})
        assert resp.status_code < 500, (case.body, resp.text[:300])
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert err["message"] and (resp.status_code != 400 or err["param"]), resp.text[:300]

    check()
    if mode is GenerationMode.NEGATIVE:
        assert statuses.get(400, 0) > 0  # the violations were seen as such
    else:
        assert statuses.get(200, 0) > 0  # valid requests were served, not only refused
    assert_alive_and_clean(worker)


def test_the_narrowed_check_still_fails_valid_data_refused_for_another_reason(worker):
    """The exceptions are only the context, a constraint that does not compile, a tool call's
    arguments that are not a JSON object and the tools' rules the schema does not state: a valid
    request refused for anything else fails."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{worker.http}/openapi.json", timeout=10).json())
    seen = []

    @settings(max_examples=1)
    @given(case=schema["/v1/completions"]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE))
    def grab(case):
        seen.append(case)

    grab()
    case = seen[0]
    case.body = {"prompt": "hi", "max_tokens": 95}
    context = case.call(base_url=worker.http, timeout=60)  # 'hi' + 95 tokens > max_model_len 96
    assert context.status_code == 400 and context.json()["error"]["param"] == "max_tokens"
    case.validate_response(context, checks=[positive_data_accepted_within_context])

    def refused(param, message):
        resp = httpx.Response(400, json={"error": {"message": message, "type": "invalid_request_error",
                                                   "param": param, "code": 400}}, request=httpx.Request(
            "POST", f"{worker.http}/v1/completions", json=case.body))
        resp.read()
        resp.elapsed = datetime.timedelta(seconds=context.elapsed)
        return resp

    case.body = {"prompt": "hi", "guided_regex": "("}  # valid by the schema; does not compile
    case.validate_response(refused("guided_regex", "guided_regex: does not compile"),
                           checks=[positive_data_accepted_within_context])
    arguments = "messages[1].tool_calls[0].function.arguments"
    case.validate_response(refused(arguments, f"{arguments}: must be a JSON object as text"),
                           checks=[positive_data_accepted_within_context])
    for param, message in (("tools[1].function.name", "tools[1].function.name: 'f' is also tools[0]'s; tool names "
                                                      "must be unique"),
                           ("tool_choice", "tool_choice: function 'g' is not one of the tools (f)"),
                           ("tools[0].function.parameters", "tools[0].function.parameters: is not a JSON schema")):
        case.validate_response(refused(param, message), checks=[positive_data_accepted_within_context])
    for param, message in (("request_id", "request_id: already in flight"), ("max_tokens", "max_tokens: too big"),
                           ("structured_outputs.choice", "structured_outputs.choice: refused"),
                           ("messages[1].tool_call_id", "messages[1].tool_call_id: required"),
                           ("messages[1].tool_calls[0].function.name", "messages[1].tool_calls[0].function.name: x"),
                           ("structured_outputs", "structured_outputs: not with tool_choice required (its ...)")):
        try:
            case.validate_response(refused(param, message), checks=[positive_data_accepted_within_context])
        except FailureGroup as group:
            assert [type(f).__name__ for f in group.exceptions] == ["RejectedPositiveData"]
        else:
            pytest.fail(f"a valid request refused for {param} passed the check")


ST_CONFIG = """
# Each request may take this long (schemathesis' default, 10 s, is short for a CPU worker
# generating tokens on 2 cores that the rest of a CI run keeps busy).
request-timeout = 60

# A body over limits.max_body_bytes is refused before it is parsed: 413 is a rejection too.
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
"""
ST_HOOKS = """
import ast
import threading

import schemathesis
from tests.fuzz.test_surfaces import positive_data_accepted_within_context

schemathesis.check(positive_data_accepted_within_context)

# CPython 3.11 keeps the AST constructor's recursion depth in state that its threads share
# (python/cpython#106905): two of schemathesis' worker threads parsing at once (hypothesis
# parses its lambdas' source to name them) can fail with "SystemError: AST constructor
# recursion depth mismatch". One parse at a time in this process; the server is not touched.
_parse, _parse_lock = ast.parse, threading.Lock()


def _one_parse_at_a_time(*args, **kwargs):
    with _parse_lock:
        return _parse(*args, **kwargs)


ast.parse = _one_parse_at_a_time
"""


def test_schemathesis_cli_all_checks_all_phases(worker, tmp_path):
    """`schemathesis run --checks all` as a user runs it: examples, coverage (the schema's
    boundaries: longest strings, largest numbers, fullest lists) and fuzzing phases."""
    (tmp_path / "st.toml").write_text(ST_CONFIG)
    (tmp_path / "pdserve_st_hooks.py").write_text(ST_HOOKS)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "pdserve_st_hooks", "PYTHONPATH": f"{tmp_path}:{root}"}
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(tmp_path / "st.toml"), "run",
         f"{worker.http}/openapi.json", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance", "--phases", "examples,coverage,fuzzing",
         "-n", str(examples(10)), "--seed", "1", "--generation-deterministic",
         "--workers", "4"],  # (the coverage phase's 1,500 cases: 80 s one at a time, 58 s four at once)
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "positive_data_accepted_within_context" in run.stdout or "5 passed" in run.stdout
    assert_alive_and_clean(worker)


# -- gRPC ---------------------------------------------------------------------------------
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([1e-40, 0.0, 1.0, 2.0, -0.0]))
SAMPLING_FIELDS = {
    "max_tokens": st.one_of(st.integers(-2, 8), INT64), "temperature": FLOATS, "top_k": st.one_of(st.integers(-2, 9), INT64),
    "top_p": FLOATS, "seed": INT64, "presence_penalty": FLOATS, "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS, "logprobs": st.one_of(st.integers(-1, 21), INT64),
    "stop": st.lists(st.text(max_size=5), max_size=3), "stop_token_ids": st.lists(INT64, max_size=3),
    "ignore_eos": st.booleans(),
    "min_p": FLOATS, "min_tokens": st.one_of(st.integers(-1, 9), INT64), "prompt_logprobs": st.integers(-1, 3),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-1, 40000), INT64), FLOATS, max_size=3),
    "allowed_token_ids": st.lists(st.one_of(st.integers(-1, 40000), INT64), max_size=3),
    "bad_words": st.lists(st.text(max_size=5), max_size=2),
    "structured_outputs": st.one_of(
        st.builds(pb.StructuredOutputs, regex=st.text(max_size=8)),
        st.builds(pb.StructuredOutputs, json=st.sampled_from(['{"type": "boolean"}', '{"type": "nope"}', "{", ""])),
        st.builds(pb.StructuredOutputs, choice=st.builds(pb.Choices, choices=st.lists(st.text(max_size=4), max_size=3))),
        st.builds(pb.StructuredOutputs, grammar=st.text(max_size=12), disable_any_whitespace=st.booleans()),
        st.builds(pb.StructuredOutputs, json_object=st.booleans(), disable_additional_properties=st.booleans()),
        st.builds(pb.StructuredOutputs, structural_tag=st.text(max_size=8)), st.just(pb.StructuredOutputs())),
}


@st.composite
def generate_requests(draw):
    sampling = pb.SamplingParams(**draw(st.fixed_dictionaries({}, optional=SAMPLING_FIELDS)))
    req = pb.GenerateRequest(sampling=sampling, request_id=draw(st.text(max_size=12)), model=draw(
        st.sampled_from(["", "other-model"])), priority=draw(st.integers(-1, 4)), route=draw(st.integers(-1, 4)))
    which = draw(st.sampled_from(["text", "ids", "none"]))
    if which == "text":
        req.text = draw(st.text(max_size=40))
    elif which == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(-3, 40000), INT64), max_size=20)))
    if draw(st.booleans()):
        req.ttft_slo_ms = draw(FLOATS)
    return req


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}  # NOT_FOUND: model "other-model"


@pytest.mark.parametrize("what", ["messages", "raw_bytes"])
def test_grpc_inputs_get_typed_statuses(worker, what):
    """Generated GenerateRequest messages with any field values, or raw bytes."""
    with grpc.insecure_channel(worker.grpc) as ch:
        if what == "messages":
            call, inputs = ch.unary_stream("/pdserve.v1.Inference/Generate",
                                           request_serializer=pb.GenerateRequest.SerializeToString,
                                           response_deserializer=pb.GenerateResponse.FromString), generate_requests()
        else:
            call, inputs = ch.unary_stream("/pdserve.v1.Inference/Generate"), st.binary(max_size=64)

        @settings(max_examples=examples(80))
        @given(inputs)
        def check(request):
            try:
                list(call(request, timeout=60))
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            assert code in ALLOWED, (request, code)

        check()
    assert_alive_and_clean(worker)
