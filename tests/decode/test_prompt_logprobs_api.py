"""vLLM's ``prompt_logprobs`` on a live decode worker, through both APIs: the official OpenAI SDK
(completions: on each choice; chat: at the top level, vLLM's shapes), streamed (on the first
chunk) and whole alike, completions' ``echo`` with ``logprobs`` (the prompt's tokens first, the
first one null), gRPC's ``GenerateResponse.prompt_logprobs``; the router keeps such a request
local, every prompt position computed (reason ``prompt_logprobs``, no cached tokens)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from pdserve.api import Client
from pdserve.engine import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def sdk(worker):
    with OpenAI(base_url=f"{worker.http}/v1", api_key="not-used", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(llama_dir, worker):
    """The prompt's logprobs from an offline engine on the same model directory."""
    ids = worker.worker.engine.tokenizer.encode(PROMPT)
    out = LLM(llama_dir).generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    return ids, out.prompt_logprobs


def check_vllm_shape(got: list, ids: list[int], ref: list[dict], top: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry, want = got[p], ref[p]
        mine = entry[str(ids[p])]
        assert mine["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        assert mine["rank"] == want["rank"] and isinstance(mine["decoded_token"], str)
        assert 1 <= len(entry) <= top + 1  # the prompt token and the top ones (it may be one of them)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(ids[p]) or v["rank"] <= top)
        assert ranks[:top] == list(range(1, top + 1))


def test_completions_carry_them_on_each_choice(sdk, reference):
    ids, ref = reference
    r = sdk.completions.create(model="llama", prompt=PROMPT, max_tokens=3, temperature=0.0, n=2,
                               extra_body={"prompt_logprobs": 2})
    for choice in r.choices:
        check_vllm_shape(choice.model_extra["prompt_logprobs"], ids, ref, 2)
    assert r.choices[0].model_extra["pdserve"]["cached_tokens"] == 0


def test_streamed_completion_has_them_on_the_first_chunk_of_each_choice(sdk, reference):
    ids, ref = reference
    seen: dict[int, list] = {}
    for chunk in sdk.completions.create(model="llama", prompt=PROMPT, max_tokens=4, temperature=0.0, stream=True,
                                        extra_body={"prompt_logprobs": 2, "ignore_eos": True}):
        for c in chunk.choices:
            got = (c.model_extra or {}).get("prompt_logprobs")
            if got is not None:
                assert c.index not in seen, "prompt_logprobs sent twice"
                seen[c.index] = got
    assert list(seen) == [0]
    check_vllm_shape(seen[0], ids, ref, 2)


def test_chat_has_them_at_the_top_level(sdk, worker):
    r = sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, temperature=0.0,
                                    extra_body={"prompt_logprobs": 1})
    got = r.model_extra["prompt_logprobs"]
    assert got[0] is None and all(isinstance(e, dict) and 1 <= len(e) <= 2 for e in got[1:])
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})
    chunks = list(sdk.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, temperature=0.0,
                                              stream=True, extra_body={"prompt_logprobs": 1}))
    streamed = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert streamed == [got]


def test_echo_with_logprobs_reports_the_prompt_tokens_first(sdk, reference):
    ids, ref = reference
    r = sdk.completions.create(model="llama", prompt=PROMPT, max_tokens=3, temperature=0.0, echo=True,
                               logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e["logprob"] for e in ref[1:]], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # the token and the 2 most likely


def test_grpc_first_message_carries_them(worker, reference):
    ids, ref = reference
    with Client(worker.grpc) as c:
        msgs = list(c.stream(ids, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
        whole = c.generate(ids, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    carrying = [m for m in msgs if m.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0] is msgs[0] and list(msgs[0].token_ids)
    got = whole.prompt_logprobs
    assert got[0] == {"token_id": ids[0], "logprob": None, "rank": None, "top_logprobs": {}}
    assert [e["token_id"] for e in got] == ids
    assert [e["rank"] for e in got[1:]] == [e["rank"] for e in ref[1:]]
    assert [e["logprob"] for e in got[1:]] == pytest.approx([e["logprob"] for e in ref[1:]], abs=1e-4)
    assert all(len(e["top_logprobs"]) == 2 for e in got[1:])


def test_the_router_keeps_them_local_and_says_why(worker):
    with Client(worker.grpc) as c:
        c.generate(PROMPT, max_tokens=1, temperature=0.0)  # the prompt's prefix is now in the pool
        out = c.generate(PROMPT, max_tokens=1, temperature=0.0, route="remote", prompt_logprobs=0)
    b = out.breakdown
    assert b["route"] == "local" and b["reason"].startswith("prompt_logprobs") and b["cached_tokens"] == 0


@pytest.mark.parametrize("value", [21, -1, "1", 1.5, True])
def test_bad_values_are_400_naming_the_field(worker, value):
    r = httpx.post(f"{worker.http}/v1/completions", timeout=60,
                   json={"prompt": "hi", "max_tokens": 1, "prompt_logprobs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
