"""What a gateway sends a decode worker for one attempt of a stream: the `GenerateRequest`
(api/client.py `build_request`) with every sampling field the gRPC API carries, so the worker
runs the request the client sent (its structured output, logits controls, stops), and with the
tokens the client already has as `resume_token_ids` when the stream moved from another worker.
Also the readers of a refusal's trailing metadata."""

from __future__ import annotations

from typing import Any

from pdserve.api.client import build_request
from pdserve.api.ingress import GenerateInput
from pdserve.api.v1 import inference_pb2 as pb
from pdserve.engine.request import SamplingParams

# The fields of a request's validated `SamplingParams` the worker is given (`build_request`'s
# keywords): all but `skip_special_tokens` (the worker's text is its own). `structured_outputs`
# goes as the engine's dict (a chat request's tool grammar too: tool_choice required or named),
# so the worker constrains the output, and a stream resumed on another worker advances the
# grammar over `resume_token_ids` (docs/structured.md, "Through the gateway").
SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logprobs", "min_p", "min_tokens", "prompt_logprobs", "stop", "stop_token_ids",
            "ignore_eos", "logit_bias", "allowed_token_ids", "bad_words", "structured_outputs")


def sampling_of(params: SamplingParams) -> dict[str, Any]:
    """The keywords of `build_request` that carry ``params`` to a worker (`SAMPLING`)."""
    return {k: getattr(params, k) for k in SAMPLING}


def worker_request(ids: list[int], rid: str, params: SamplingParams, priority: str, inp: GenerateInput,
                   streamed: list[int], adapter: str | None = None) -> pb.GenerateRequest:
    """One attempt's call: the prompt's token ids, the worker-side id ``rid``, the priority's
    label, and the tokens already ``streamed`` to the client (resumed there; none on a first
    attempt). ``adapter``: the LoRA adapter it runs under, named as its ``model`` (None: the
    base model, no model named)."""
    return build_request(ids, request_id=rid, model=adapter or "", priority=priority, route=inp.route,
                         ttft_slo_ms=inp.ttft_slo_ms, resume_token_ids=list(streamed) if streamed else None,
                         **sampling_of(params))


def metadata_float(v) -> float | None:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def metadata_int(v) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
