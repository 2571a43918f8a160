"""A small Python client for the pdserve Inference gRPC API (sync and asyncio)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import grpc

from .v1 import inference_pb2 as pb
from .v1 import inference_pb2_grpc as pb_grpc

_PRIORITY = {"normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH, "low": pb.PRIORITY_LOW}
_ROUTE = {"auto": pb.ROUTE_AUTO, "local": pb.ROUTE_LOCAL, "remote": pb.ROUTE_REMOTE}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logprobs")


@dataclass
class Completion:
    """A finished generation as the client saw it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    breakdown: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)


def build_request(prompt: str | list[int], *, request_id: str | None = None, model: str = "",
                  priority: str = "normal", route: str = "auto", ttft_slo_ms: float | None = None,
                  stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                  ignore_eos: bool = False, **sampling) -> pb.GenerateRequest:
    """Build a GenerateRequest; sampling keywords use the engine's names."""
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    if priority not in _PRIORITY:
        raise ValueError(f"priority={priority!r}; use normal, high or low")
    if route not in _ROUTE:
        raise ValueError(f"route={route!r}; use auto, local or remote")
    sp = pb.SamplingParams(stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos)
    for k, v in sampling.items():
        if v is not None:
            setattr(sp, k, v)
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, model=model, sampling=sp,
                             priority=_PRIORITY[priority], route=_ROUTE[route])
    if ttft_slo_ms is not None:
        req.ttft_slo_ms = ttft_slo_ms
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def breakdown_dict(b: pb.Breakdown) -> dict:
    return {f.name: getattr(b, f.name) for f in b.DESCRIPTOR.fields}


def _model_card(m: pb.ModelCard) -> dict:
    return {"id": m.id, "max_model_len": m.max_model_len, "vocab_size": m.vocab_size, "dtype": m.dtype}


def _accumulate(out: Completion, msg: pb.GenerateResponse) -> None:
    out.token_ids.extend(msg.token_ids)
    out.text += msg.text
    for lp in msg.logprobs:
        out.logprobs.append({"token_id": lp.token_id, "logprob": lp.logprob,
                             "top_logprobs": {t.token_id: t.logprob for t in lp.top}})
    if msg.finish_reason:
        out.finish_reason = msg.finish_reason
        out.breakdown = breakdown_dict(msg.breakdown)


class Client:
    """Blocking client: ``Client("127.0.0.1:50051").generate("Hello", max_tokens=16)``."""

    def __init__(self, target: str, timeout_s: float = 120.0):
        self.target = target
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.InferenceStub(self._channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def stream(self, prompt, timeout_s: float | None = None, **kwargs):
        """Yield GenerateResponse messages as the server streams them."""
        req = build_request(prompt, **kwargs)
        yield from self._stub.Generate(req, timeout=timeout_s or self.timeout_s)

    def generate(self, prompt, timeout_s: float | None = None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        out = Completion(req.request_id)
        for msg in self._stub.Generate(req, timeout=timeout_s or self.timeout_s):
            _accumulate(out, msg)
        return out

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s).found

    def list_models(self) -> list[dict]:
        resp = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s)
        return [_model_card(m) for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client with the same methods (for load generators and tests)."""

    def __init__(self, target: str, timeout_s: float = 120.0):
        self.target = target
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def stream(self, prompt, timeout_s: float | None = None, **kwargs):
        req = build_request(prompt, **kwargs)
        async for msg in self._stub.Generate(req, timeout=timeout_s or self.timeout_s):
            yield msg

    async def generate(self, prompt, timeout_s: float | None = None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        out = Completion(req.request_id)
        async for msg in self._stub.Generate(req, timeout=timeout_s or self.timeout_s):
            _accumulate(out, msg)
        return out

    async def abort(self, request_id: str) -> bool:
        resp = await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s)
        return resp.found

    async def list_models(self) -> list[dict]:
        resp = await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s)
        return [_model_card(m) for m in resp.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
