"""The official `openai` Python SDK against a live decode worker (loopback): what a vLLM
user's code does, unchanged but for base_url. Errors must come out as the SDK's typed
exceptions, with the field in ``param``."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from pdserve.api import Client
from pdserve.api.ingress import RequestError

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def sdk(worker):
    with OpenAI(base_url=f"{worker.http}/v1", api_key="not-used", max_retries=0, timeout=120) as client:
        yield client


def test_models_list(sdk, worker):
    models = sdk.models.list().data
    assert [m.id for m in models] == ["llama"] and models[0].object == "model" and models[0].created > 0


def test_completion_equals_the_grpc_answer(sdk, worker):
    out = sdk.completions.create(model="llama", prompt="The quick brown fox", max_tokens=8, temperature=0)
    with Client(worker.grpc) as c:
        ref = c.generate("The quick brown fox", max_tokens=8, temperature=0.0)
    assert out.object == "text_completion" and out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids) and out.usage.total_tokens == \
        out.usage.prompt_tokens + out.usage.completion_tokens


def test_batched_prompts_and_n(sdk):
    out = sdk.completions.create(model="llama", prompt=["first prompt", "second one"], max_tokens=3, n=2,
                                 temperature=1.0, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)  # extra fields kept


def test_chat_completion(sdk):
    out = sdk.chat.completions.create(model="llama", messages=CHAT, max_completion_tokens=6, temperature=0,
                                      seed=1, user="tester", stop=["\n\n"])
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_chat_stream_with_usage(sdk):
    whole = sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0)
    stream = sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream(sdk):
    whole = sdk.completions.create(model="llama", prompt="Once upon", max_tokens=5, temperature=0)
    parts = [c.choices[0].text for c in sdk.completions.create(model="llama", prompt="Once upon", max_tokens=5,
                                                                temperature=0, stream=True)]
    assert "".join(parts) == whole.choices[0].text


def test_logprobs(sdk):
    out = sdk.completions.create(model="llama", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    chat = sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_pdserve_extensions_through_extra_body(sdk):
    out = sdk.completions.create(model="llama", prompt="Hi", max_tokens=2, extra_body={
        "priority": "high", "route": "local", "ignore_eos": True, "top_k": 5})
    assert out.choices[0].pdserve["route"] == "local"


def test_bad_parameter_is_bad_request_error_naming_it(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="llama", prompt="hi", temperature=-1)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="llama", messages=CHAT, response_format={"type": "yaml"})
    assert info.value.param == "response_format.type"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="llama", prompt="hi", max_tokens=511)
    assert info.value.param == "max_tokens" and "max_model_len" in info.value.message


def test_unknown_model_is_not_found_error(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert info.value.param == "model"


def test_qos_refusal_and_draining_are_typed(sdk, worker, monkeypatch):
    fe = worker.worker.frontend

    async def refuse(inp):
        raise RequestError("resource_exhausted", "refused: predicted TTFT 900 ms", None, 900.0, 1500)

    monkeypatch.setattr(fe, "prepare", refuse)
    with pytest.raises(openai.RateLimitError) as info:
        sdk.completions.create(model="llama", prompt="hi", max_tokens=2)
    assert info.value.response.headers["retry-after"] == "2"
    assert info.value.response.headers["retry-after-ms"] == "1500"
    monkeypatch.undo()
    monkeypatch.setattr(fe, "draining", True)
    with pytest.raises(openai.InternalServerError) as info:
        sdk.completions.create(model="llama", prompt="hi", max_tokens=2)
    assert info.value.status_code == 503
    monkeypatch.undo()
    assert sdk.completions.create(model="llama", prompt="hi", max_tokens=2).choices


def test_error_inside_a_stream_raises_api_error(sdk, worker):
    """A failure after the 200 arrives as an error event, which the SDK raises."""
    victim = "sdk-stream-victim"

    def sabotage(engine):
        def push(token_id, stops_on=True):
            raise TypeError("injected detokenizer failure")
        engine._detok[worker.worker.frontend.engine_id(victim)].push = push

    stream = sdk.completions.create(model="llama", prompt="Tell me", max_tokens=50, stream=True,
                                    extra_body={"request_id": victim, "ignore_eos": True})
    with pytest.raises(openai.APIError) as info:
        for i, _ in enumerate(stream):
            if i == 1:
                worker.worker.async_engine.call(sabotage)
    assert "injected detokenizer failure" in str(info.value)


def test_async_client_streams_concurrently(worker):
    async def run():
        async with AsyncOpenAI(base_url=f"{worker.http}/v1", api_key="x", max_retries=0) as client:
            async def one(i):
                stream = await client.completions.create(model="llama", prompt=f"prompt {i}", max_tokens=4,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                return "".join([c.choices[0].text async for c in stream])
            return await asyncio.gather(*(one(i) for i in range(4)))

    texts = asyncio.run(run())
    with Client(worker.grpc) as c:
        assert texts == [c.generate(f"prompt {i}", max_tokens=4, temperature=0.0, ignore_eos=True).text
                         for i in range(4)]


def test_the_sdk_retries_a_refusal_after_the_exact_hint(worker, monkeypatch):
    """A refused request (429) carries retry-after-ms: the SDK's own retry waits for it (it reads
    it before the whole seconds of Retry-After) and the retry is served."""
    fe = worker.worker.frontend
    real, calls = fe.prepare, []

    async def refuse_once(inp):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RequestError("resource_exhausted", "refused: the KV pool is full", None, 200.0, 200)
        return await real(inp)

    monkeypatch.setattr(fe, "prepare", refuse_once)
    with OpenAI(base_url=f"{worker.http}/v1", api_key="not-used", max_retries=1, timeout=120) as client:
        out = client.completions.create(model="llama", prompt="hi", max_tokens=2)
    assert out.choices and len(calls) == 2
    assert calls[1] - calls[0] >= 0.2, "the retry came before the server's hint"
