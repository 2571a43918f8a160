"""Property: for random small JSON schemas (objects of bounded strings, bounded integers,
booleans, enums, bounded arrays and objects, nested at most twice), the engine's output under
the schema is always JSON that validates (greedy and seeded, on a random model that would
otherwise write anything). Bounded examples, derandomized."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine import LLM, SamplingParams

NAMES = ["a", "b", "name", "x_1", "kind"]

leaf = st.one_of(
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "green", "blue sky", "x"]), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"enum": xs}),
)


def arrays(items):
    return st.tuples(items, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})


def objects(values):
    return st.dictionaries(st.sampled_from(NAMES), values, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": list(props),
                       "additionalProperties": False})


schemas = objects(st.one_of(leaf, arrays(leaf), objects(leaf)))  # nesting depth <= 2


def valid(schema: dict, v) -> bool:
    """``v`` validates against ``schema`` (the subset the strategy above draws from)."""
    if "enum" in schema:
        return v in schema["enum"]
    t = schema["type"]
    if t == "string":
        return isinstance(v, str) and len(v) <= schema["maxLength"]
    if t == "integer":
        return type(v) is int and schema["minimum"] <= v <= schema["maximum"]
    if t == "boolean":
        return isinstance(v, bool)
    if t == "array":
        return isinstance(v, list) and len(v) <= schema["maxItems"] and all(valid(schema["items"], x) for x in v)
    props = schema["properties"]
    return isinstance(v, dict) and set(v) == set(props) and all(valid(props[k], v[k]) for k in props)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, max_model_len=512) as llm:
        yield llm


@settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_random_schemas_always_yield_json_that_validates(llm, schema, seed):
    so = {"json": schema, "disable_any_whitespace": True}
    params = [SamplingParams(max_tokens=320, temperature=0.0, structured_outputs=so),
              SamplingParams(max_tokens=320, temperature=1.0, seed=seed, structured_outputs=so)]
    prompt = [(seed + 7 * i) % 31000 + 3 for i in range(10)]
    for o in llm.generate([prompt, prompt], params):
        assert o.finish_reason == "stop", (schema, o.text)
        assert valid(schema, json.loads(o.text)), (schema, o.text)
