"""A small Python client for the pdserve Inference gRPC API (sync and asyncio).

Security (docs/security.md): ``api_key`` is sent as ``authorization: Bearer <key>``
metadata on every call; ``ca_file`` turns TLS on and verifies the server with that CA
(``tls=True`` without one: the system's trust store); ``client_cert`` / ``client_key``
are presented under mutual TLS. Each falls back to the environment: PDSERVE_API_KEY,
PDSERVE_CA_FILE, PDSERVE_CLIENT_CERT, PDSERVE_CLIENT_KEY.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from .v1 import inference_pb2 as pb
from .v1 import inference_pb2_grpc as pb_grpc

_PRIORITY = {"normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH, "low": pb.PRIORITY_LOW}
_ROUTE = {"auto": pb.ROUTE_AUTO, "local": pb.ROUTE_LOCAL, "remote": pb.ROUTE_REMOTE}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logprobs", "min_p", "min_tokens", "prompt_logprobs")
_STRUCTURED_TEXT = ("json", "regex", "grammar", "structural_tag")


@dataclass
class Completion:
    """A finished generation as the client saw it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    breakdown: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)
    # prompt_logprobs asked: an entry per prompt token (the first with logprob and rank None)
    prompt_logprobs: list[dict] | None = None


def prompt_logprobs_of(msg: pb.GenerateResponse) -> list[dict] | None:
    """A message's prompt logprobs as the engine's entries; None when it carries none."""
    if not msg.prompt_logprobs:
        return None
    return [{"token_id": lp.token_id, "logprob": lp.logprob if lp.rank else None, "rank": lp.rank or None,
             "top_logprobs": {t.token_id: t.logprob for t in lp.top}} for lp in msg.prompt_logprobs]


def build_request(prompt: str | list[int], *, request_id: str | None = None, model: str = "",
                  priority: str = "normal", route: str = "auto", ttft_slo_ms: float | None = None,
                  stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
                  ignore_eos: bool = False, resume_token_ids: list[int] | None = None,
                  logit_bias: Mapping[int | str, float] | None = None, allowed_token_ids: list[int] | None = None,
                  bad_words: list[str] | None = None, structured_outputs: Mapping[str, Any] | None = None,
                  **sampling) -> pb.GenerateRequest:
    """Build a GenerateRequest; sampling keywords use the engine's names. ``resume_token_ids``:
    the tokens a failed worker already streamed for it (the proto's field; a gateway's).
    ``logit_bias``: token id (or its decimal string, as OpenAI writes it) -> bias;
    ``structured_outputs``: as the engine's `SamplingParams` takes it (vLLM's names: one of
    json (a schema: dict or JSON text), regex, choice, grammar, json_object, structural_tag, and
    the options disable_any_whitespace, disable_additional_properties)."""
    unknown = set(sampling) - set(_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    if priority not in _PRIORITY:
        raise ValueError(f"priority={priority!r}; use normal, high or low")
    if route not in _ROUTE:
        raise ValueError(f"route={route!r}; use auto, local or remote")
    sp = pb.SamplingParams(stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos,
                           allowed_token_ids=allowed_token_ids or [], bad_words=bad_words or [])
    for token, bias in (logit_bias or {}).items():
        sp.logit_bias[int(token)] = bias
    if structured_outputs is not None:
        sp.structured_outputs.CopyFrom(structured_to_proto(structured_outputs))
    for k, v in sampling.items():
        if v is not None:
            setattr(sp, k, v)
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, model=model, sampling=sp,
                             priority=_PRIORITY[priority], route=_ROUTE[route])
    if ttft_slo_ms is not None:
        req.ttft_slo_ms = ttft_slo_ms
    if resume_token_ids is not None:
        req.resume_token_ids.ids.extend(resume_token_ids)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def structured_to_proto(so: Mapping[str, Any]) -> pb.StructuredOutputs:
    """The proto's `StructuredOutputs` of the engine's dict (a schema or tag given as a dict is
    sent as its JSON text); ValueError for a key the proto lacks."""
    msg = pb.StructuredOutputs()
    for key, value in so.items():
        if value is None or (key == "json_object" and value is False):  # absent, as the engine reads it
            continue
        if key in _STRUCTURED_TEXT:
            setattr(msg, key, value if isinstance(value, str) else json.dumps(value))
        elif key == "choice":
            msg.choice.choices.extend(value)
        elif key in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            setattr(msg, key, value)
        else:
            raise ValueError(f"structured_outputs: unknown key {key!r}")
    return msg


def breakdown_dict(b: pb.Breakdown) -> dict:
    """Its fields by name; an `optional` one (the speculative decoding counts) only when set."""
    return {f.name: getattr(b, f.name) for f in b.DESCRIPTOR.fields if not f.has_presence or b.HasField(f.name)}


def _model_card(m: pb.ModelCard) -> dict:
    card = {"id": m.id, "max_model_len": m.max_model_len, "vocab_size": m.vocab_size, "dtype": m.dtype}
    if m.parent:  # a LoRA adapter: its directory and base model
        card.update(root=m.root, parent=m.parent)
    return card


def _accumulate(out: Completion, msg: pb.GenerateResponse) -> None:
    out.token_ids.extend(msg.token_ids)
    out.text += msg.text
    for lp in msg.logprobs:
        out.logprobs.append({"token_id": lp.token_id, "logprob": lp.logprob,
                             "top_logprobs": {t.token_id: t.logprob for t in lp.top}})
    if msg.prompt_logprobs:
        out.prompt_logprobs = prompt_logprobs_of(msg)
    if msg.finish_reason:
        out.finish_reason = msg.finish_reason
        out.breakdown = breakdown_dict(msg.breakdown)


class Connection:
    """Target, credentials and per-call metadata, shared by both clients (and a gateway's
    channels to its decode workers, gateway/backends.py)."""

    def __init__(self, target: str, timeout_s: float, api_key: str | None, ca_file: str | None,
                 client_cert: str | None, client_key: str | None, tls: bool | None, server_name: str | None = None):
        self.target = target
        # TLS: the name the server's certificate must carry, when not the address dialled
        self.server_name = server_name
        self.timeout_s = timeout_s
        env = os.environ.get
        api_key = api_key if api_key is not None else env("PDSERVE_API_KEY") or None
        ca_file = ca_file if ca_file is not None else env("PDSERVE_CA_FILE") or None
        client_cert = client_cert if client_cert is not None else env("PDSERVE_CLIENT_CERT") or None
        client_key = client_key if client_key is not None else env("PDSERVE_CLIENT_KEY") or None
        if bool(client_cert) != bool(client_key):
            raise ValueError("client_cert and client_key: give both (mutual TLS) or neither")
        self.tls = tls if tls is not None else bool(ca_file or client_cert)
        if not self.tls and (ca_file or client_cert):
            raise ValueError("tls=False with ca_file or client_cert: those are TLS settings")
        self._creds = None
        if self.tls:
            read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
            self._creds = grpc.ssl_channel_credentials(root_certificates=read(ca_file), private_key=read(client_key),
                                                       certificate_chain=read(client_cert))
        # Metadata, not call credentials: grpc sends those only over TLS, and a key on a
        # loopback worker without TLS is a valid setup.
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def channel(self, aio: bool):
        mod = grpc.aio if aio else grpc
        if not self.tls:
            return mod.insecure_channel(self.target)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else None
        return mod.secure_channel(self.target, self._creds, options=options)


class Client:
    """Blocking client: ``Client("127.0.0.1:50051").generate("Hello", max_tokens=16)``;
    ``Client(target, api_key=..., ca_file="ca.pem")`` against a secured worker."""

    def __init__(self, target: str, timeout_s: float = 120.0, *, api_key: str | None = None,
                 ca_file: str | None = None, client_cert: str | None = None, client_key: str | None = None,
                 tls: bool | None = None, server_name: str | None = None):
        self._conn = Connection(target, timeout_s, api_key, ca_file, client_cert, client_key, tls, server_name)
        self.target = target
        self.timeout_s = timeout_s
        self._md = self._conn.metadata
        self._channel = self._conn.channel(aio=False)
        self._stub = pb_grpc.InferenceStub(self._channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def stream(self, prompt, timeout_s: float | None = None, **kwargs):
        """Yield GenerateResponse messages as the server streams them. Closing the generator
        early (or leaving a ``for`` loop over it and dropping it) cancels the call, so the
        server stops generating for nobody."""
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._md)
        try:
            yield from call
        finally:
            call.cancel()  # no-op once the call has ended

    def generate(self, prompt, timeout_s: float | None = None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        out = Completion(req.request_id)
        for msg in self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._md):
            _accumulate(out, msg)
        return out

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s, metadata=self._md).found

    def list_models(self) -> list[dict]:
        resp = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s, metadata=self._md)
        return [_model_card(m) for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """asyncio client with the same methods and security settings (for load generators and tests)."""

    def __init__(self, target: str, timeout_s: float = 120.0, *, api_key: str | None = None,
                 ca_file: str | None = None, client_cert: str | None = None, client_key: str | None = None,
                 tls: bool | None = None, server_name: str | None = None):
        self._conn = Connection(target, timeout_s, api_key, ca_file, client_cert, client_key, tls, server_name)
        self.target = target
        self.timeout_s = timeout_s
        self._md = self._conn.metadata
        self._channel = self._conn.channel(aio=True)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def stream(self, prompt, timeout_s: float | None = None, **kwargs):
        """As `Client.stream`: `aclose()` before the end cancels the call."""
        req = build_request(prompt, **kwargs)
        call = self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._md)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()  # no-op once the call has ended

    async def generate(self, prompt, timeout_s: float | None = None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        out = Completion(req.request_id)
        async for msg in self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self._md):
            _accumulate(out, msg)
        return out

    async def abort(self, request_id: str) -> bool:
        resp = await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout_s, metadata=self._md)
        return resp.found

    async def list_models(self) -> list[dict]:
        resp = await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s, metadata=self._md)
        return [_model_card(m) for m in resp.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
