"""Property-based tests: no input makes a parser or validator fail with anything but its
own typed error, and parameters that pass validation never make the engine fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.engine import LLM, InvalidRequestError, SamplingParams
from pdserve.kvtransfer import PrefillTask
from pdserve.kvtransfer.notices import MalformedNoticeError, PrefillDone, decode_prefill_done
from pdserve.router.loader import PolicyError, parse_any
from pdserve.cluster.queue.frames import WireError, from_wire, pack_frame, read_frame
from tests.fuzz.profiles import examples

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Any JSON/YAML-ish value, the odd floats included.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
)


def _nested(leaves):
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


values = _nested(scalars)
# What msgpack can carry: 64-bit integers.
wire_values = _nested(st.one_of(scalars.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
                                st.integers(min_value=-(2**63), max_value=2**64 - 1)))


# -- sampling parameters --------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=64, max_num_seqs=4)


param_values = {
    "max_tokens": st.one_of(st.integers(-5, 6), st.integers(min_value=-(2**70), max_value=2**70), scalars),
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-40, 1e-6, 1e-5, 1e4, 5e-324]), scalars),
    "top_k": st.one_of(st.integers(-2, 50), st.integers(min_value=-(2**70), max_value=2**70), scalars),
    "top_p": st.one_of(st.floats(0, 1), st.sampled_from([1e-40, 5e-324, 1.0]), scalars),
    "seed": st.one_of(st.none(), st.integers(min_value=-(2**65), max_value=2**65), scalars),
    "presence_penalty": st.one_of(st.floats(-2, 2), scalars),
    "frequency_penalty": st.one_of(st.floats(-2, 2), scalars),
    "repetition_penalty": st.one_of(st.floats(1e-40, 10), st.sampled_from([1e-40, 5e-324, 1e4]), scalars),
    "logprobs": st.one_of(st.none(), st.integers(-1, 21), scalars),
    "stop": st.one_of(st.lists(st.text(max_size=6), max_size=4), scalars),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 40000), max_size=4), scalars),
    "ignore_eos": st.one_of(st.booleans(), scalars),
}


@settings(max_examples=examples(60))
@given(st.fixed_dictionaries({}, optional=param_values))
def test_sampling_params_either_refused_by_name_or_sampled_safely(llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
        params.validate(llm.engine.model_config.vocab_size)
    except InvalidRequestError as exc:
        assert exc.field in param_values
        return
    params.max_tokens = min(params.max_tokens, 3)  # bound the work, keep everything else
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    assert out.finish_reason in ("stop", "length")
    eng = llm.engine
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


# -- PrefillDone ------------------------------------------------------------------------------
@settings(max_examples=examples(300))
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=8).map(lambda b: b"PDKV\x01" + b),
                 wire_values.map(lambda v: b"PDKV\x01" + msgpack.packb(v, use_bin_type=True))))
def test_any_notification_bytes_decode_or_raise_malformed(payload):
    try:
        msg = decode_prefill_done(payload)
    except MalformedNoticeError:
        return
    assert isinstance(msg, PrefillDone)


@settings(max_examples=examples(200))
@given(st.builds(PrefillDone, request_id=st.text(min_size=1, max_size=60), epoch=st.integers(1, 2**31),
                 first_token_id=st.integers(0, 2**31), first_token_logprob=st.one_of(
                     st.none(), st.floats(max_value=0, allow_nan=False, allow_infinity=False)),
                 num_tokens_written=st.integers(0, 2**31), queue_wait_ms=st.floats(0, 1e6),
                 prefill_ms=st.floats(0, 1e6), sent_at=st.floats(0, 4e9), prefill_worker=st.text(max_size=20)))
def test_prefill_done_round_trips(msg):
    try:
        payload = msg.encode()
    except ValueError:  # over the notification cap: refused at the sender, by design
        return
    assert decode_prefill_done(payload) == msg


# -- queue wire frames ------------------------------------------------------------------------
def _read(data: bytes):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader)
    return asyncio.run(go())


@settings(max_examples=examples(200))
@given(st.one_of(st.binary(max_size=40),
                 st.binary(max_size=30).map(lambda b: len(b).to_bytes(4, "big") + b),
                 wire_values.map(pack_frame)))
def test_any_bytes_read_as_a_frame_or_a_typed_error(data):
    try:
        _read(data)
    except (WireError, asyncio.IncompleteReadError):
        pass


@settings(max_examples=examples(200))
@given(st.one_of(values, st.fixed_dictionaries({}, optional={
    "request_id": values, "epoch": values, "token_ids": values, "cached_len": values,
    "target_worker_id": values, "target_block_ids": values, "sampling_params": values,
    "priority": values, "deadline": values, "arrival_time": values})))
def test_any_task_map_builds_a_task_or_a_typed_error(body):
    try:
        task = from_wire(PrefillTask, body, "fuzz")
    except (WireError, ValueError):
        return
    assert isinstance(task, PrefillTask)


# -- policy and topology files ----------------------------------------------------------------
def _mutations(base: dict):
    """Strategy: ``base`` with random keys replaced, added or removed at any depth."""
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + (k,))
                walk(v, path + (k,))
    walk(base, ())

    @st.composite
    def mutate(draw):
        import copy

        doc = copy.deepcopy(base)
        for _ in range(draw(st.integers(1, 4))):
            path = draw(st.sampled_from(paths))
            parent = doc
            for k in path[:-1]:
                parent = parent.get(k) if isinstance(parent, dict) else None
            if not isinstance(parent, dict):
                continue
            action = draw(st.sampled_from(["replace", "add", "remove"]))
            if action == "replace":
                parent[path[-1]] = draw(values)
            elif action == "add":
                parent[draw(st.text(max_size=10))] = draw(values)
            else:
                parent.pop(path[-1], None)
        return doc

    return mutate()


def _files(folder: str) -> list[Path]:
    return sorted((CONFIGS / folder).glob("*.yaml"))


@pytest.mark.parametrize("path", _files("router") + _files("autoscale"), ids=lambda p: p.name)
def test_any_policy_document_parses_or_raises_policy_error(path):
    base = yaml.safe_load(path.read_text())

    @settings(max_examples=examples(40))
    @given(st.one_of(_mutations(base).map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                     st.text(max_size=80)))
    def check(text):
        try:
            parse_any(text, source="fuzz")
        except PolicyError as exc:
            assert str(exc)

    check()


@pytest.mark.parametrize("path", _files("topologies"), ids=lambda p: p.name)
def test_any_topology_document_loads_or_raises_topology_error(path, tmp_path):
    base = yaml.safe_load(path.read_text())
    target = tmp_path / "topology.yaml"

    @settings(max_examples=examples(40))
    @given(st.one_of(_mutations(base).map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                     st.text(max_size=80)))
    def check(text):
        target.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load_topology(target, check_files=False)
        except TopologyError as exc:
            assert str(exc)

    check()


def test_nan_in_a_policy_is_refused_by_name():
    """A float key that pydantic would take as NaN is refused by the schema (the router
    must never compare against NaN)."""
    with pytest.raises(PolicyError, match="ema_alpha"):
        parse_any("router:\n  cost_model:\n    ema_alpha: .nan\n", source="fuzz")
