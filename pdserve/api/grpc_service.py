"""gRPC surface of a decode worker or a gateway (over its `Surface`): Inference +
grpc.health.v1 + server reflection (v1 and v1alpha).

Status codes are the ones api/proto/pdserve/api/v1/inference.proto documents:
INVALID_ARGUMENT (a bad field, named as the proto names it; bytes that do not
parse), NOT_FOUND (an unknown model), RESOURCE_EXHAUSTED (QoS refusal, with
predicted-ttft-ms and retry-after-ms trailers), UNAVAILABLE (draining, engine
down), INTERNAL (a bug, or a failure inside the engine for this request only: then with an
x-pdserve-error-scope: request trailer, api/ingress.py ERROR_SCOPE_HEADER); with API keys
(api/security.py): UNAUTHENTICATED (no valid key), PERMISSION_DENIED (a route override
or raised priority without an operator key). Without keys the caller is its peer's address
(api/security.py `Client`), a tenant of its own for the per-tenant caps.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pdserve.api.v1 import inference_pb2 as pb
from pdserve.api.v1 import inference_pb2_grpc as pb_grpc
from pdserve.common import Priority, jsonlog
from pdserve.common.tracing import carrier_of, trace_id_of
from pdserve.engine import SamplingParams

from .client import breakdown_dict, prompt_logprobs_of
from .ingress import ERROR_SCOPE_HEADER, Chunk, GenerateInput, RequestError, kv_wait_of_metadata
from .security import ApiKeyInterceptor, ServerSecurity
from .surface import Surface

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
_PRIORITY = {pb.PRIORITY_NORMAL: Priority.NORMAL, pb.PRIORITY_HIGH: Priority.HIGH, pb.PRIORITY_LOW: Priority.LOW}
_ROUTE = {pb.ROUTE_AUTO: "auto", pb.ROUTE_LOCAL: "local", pb.ROUTE_REMOTE: "remote"}
_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logprobs", "min_p", "min_tokens", "prompt_logprobs")
STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
}


def input_from_proto(req: pb.GenerateRequest) -> GenerateInput:
    which = req.WhichOneof("prompt")
    if which is None:
        raise RequestError("invalid_argument", "prompt: set either text or token_ids", "prompt")
    prompt = req.text if which == "text" else list(req.token_ids.ids)
    if req.priority not in _PRIORITY:
        raise RequestError("invalid_argument", f"priority: unknown value {req.priority}", "priority")
    if req.route not in _ROUTE:
        raise RequestError("invalid_argument", f"route: unknown value {req.route}", "route")
    sp = req.sampling
    kwargs = {k: getattr(sp, k) for k in _OPTIONAL if sp.HasField(k)}
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if k in kwargs:
            kwargs[k] = float(kwargs[k])
    params = SamplingParams(**kwargs, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                            ignore_eos=sp.ignore_eos, logit_bias=dict(sp.logit_bias) or None,
                            allowed_token_ids=list(sp.allowed_token_ids) or None, bad_words=list(sp.bad_words),
                            structured_outputs=structured_from_proto(sp.structured_outputs)
                            if sp.HasField("structured_outputs") else None)
    return GenerateInput(
        prompt=prompt, params=params, request_id=req.request_id or None, model=req.model or None,
        priority=_PRIORITY[req.priority], ttft_slo_ms=req.ttft_slo_ms if req.HasField("ttft_slo_ms") else None,
        route=_ROUTE[req.route],
        resume_ids=list(req.resume_token_ids.ids) if req.HasField("resume_token_ids") else None,
    )


def structured_from_proto(so: pb.StructuredOutputs) -> dict:
    """The engine's ``structured_outputs`` (vLLM's names) of the proto's message; the engine
    checks and compiles it (INVALID_ARGUMENT names ``structured_outputs.<kind>``)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise RequestError("invalid_argument", "structured_outputs: set one of json, regex, choice, grammar, "
                           "json_object, structural_tag", "structured_outputs")
    out: dict[str, Any] = {kind: list(so.choice.choices) if kind == "choice" else getattr(so, kind)}
    if so.disable_any_whitespace:
        out["disable_any_whitespace"] = True
    if so.HasField("disable_additional_properties"):
        out["disable_additional_properties"] = so.disable_additional_properties
    return out


def chunk_from_proto(msg: pb.GenerateResponse) -> Chunk:
    """What a worker streamed, as the `Chunk` it was (a gateway's view of its workers' streams)."""
    return Chunk(list(msg.token_ids), msg.text, msg.finish_reason or None,
                 [{"token_id": lp.token_id, "logprob": lp.logprob,
                   "top_logprobs": {t.token_id: t.logprob for t in lp.top}} for lp in msg.logprobs],
                 breakdown_dict(msg.breakdown) if msg.HasField("breakdown") else None,
                 prompt_logprobs_of(msg))


def chunk_to_proto(rid: str, c: Chunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=rid, token_ids=c.token_ids, text=c.text,
                              finish_reason=c.finish_reason or "")
    for lp in c.logprobs:
        msg.logprobs.append(pb.TokenLogprob(
            token_id=lp["token_id"], logprob=lp["logprob"] or 0.0,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in (lp.get("top_logprobs") or {}).items()]))
    for lp in c.prompt_logprobs or ():
        msg.prompt_logprobs.append(pb.TokenLogprob(
            token_id=lp["token_id"], logprob=lp["logprob"] or 0.0, rank=lp["rank"] or 0,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp["top_logprobs"].items()]))
    if c.breakdown is not None:
        fields = {f.name for f in pb.Breakdown.DESCRIPTOR.fields}
        msg.breakdown.CopyFrom(pb.Breakdown(**{k: v for k, v in c.breakdown.items() if k in fields}))
    return msg


class Undecodable:
    """What a request that does not parse as its message turns into: the handler
    answers INVALID_ARGUMENT (grpc would say UNKNOWN or INTERNAL for a raising deserializer)."""

    def __init__(self, message: str, exc: Exception):
        self.detail = f"request body is not a valid {message} message ({exc.__class__.__name__}: {exc})"


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as exc:  # noqa: BLE001  (DecodeError, invalid UTF-8 in a string field, ...)
            return Undecodable(message_cls.DESCRIPTOR.full_name, exc)
    return parse


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)


def add_inference_service(servicer: "InferenceService", server) -> None:
    """The generated ``add_InferenceServicer_to_server`` with lenient deserializers."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_lenient(pb.AbortRequest),
            response_serializer=pb.AbortResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_lenient(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class InferenceService(pb_grpc.InferenceServicer):
    """Maps the Inference RPCs onto a `Surface` (a decode worker's `Frontend` or a gateway's)."""

    def __init__(self, frontend: Surface, security: ServerSecurity | None = None):
        self.frontend = frontend
        self.security = security or ServerSecurity()

    async def Generate(self, request, context):
        await _refuse_undecodable(request, context)
        try:
            inp = input_from_proto(request)
            inp.request_id = inp.request_id or uuid.uuid4().hex
            inp.caller = self.security.caller_of_metadata(context.invocation_metadata(), context.peer())
            inp.kv_full_wait_ms = kv_wait_of_metadata(context.invocation_metadata())
            inp.trace = carrier_of(context.invocation_metadata())  # W3C traceparent / tracestate
            jsonlog.bind(inp.request_id, trace_id_of(inp.trace))  # this call's log lines name them
            async for chunk in self.frontend.generate(inp):
                yield chunk_to_proto(inp.request_id, chunk)
        except RequestError as exc:
            # The frontend says "prompt"; this client sent text or token_ids.
            exc = exc.renamed({"prompt": request.WhichOneof("prompt") or "prompt"})
            self.frontend.metrics.error(exc.code)
            md = []
            if exc.predicted_ttft_ms is not None:
                md.append(("predicted-ttft-ms", f"{exc.predicted_ttft_ms:.1f}"))
            if exc.retry_after_ms is not None:
                md.append(("retry-after-ms", str(exc.retry_after_ms)))
            if exc.scope is not None:  # the request's own failure: a gateway keeps this worker in rotation
                md.append((ERROR_SCOPE_HEADER, exc.scope))
            if md:
                context.set_trailing_metadata(tuple(md))
            await context.abort(STATUS[exc.code], str(exc))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001  (a bug: the client still gets a typed status)
            log.exception("Generate %s failed", request.request_id)
            self.frontend.metrics.error("internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc.__class__.__name__}: {exc}")

    async def Abort(self, request, context):
        await _refuse_undecodable(request, context)
        caller = self.security.caller_of_metadata(context.invocation_metadata(), context.peer())
        return pb.AbortResponse(found=self.frontend.abort(request.request_id, caller))

    async def ListModels(self, request, context):
        await _refuse_undecodable(request, context)
        m = self.frontend.model_card()
        card = pb.ModelCard(id=m.id, max_model_len=m.max_model_len, vocab_size=m.vocab_size, dtype=m.dtype)
        adapters = [pb.ModelCard(id=a.id, max_model_len=m.max_model_len, vocab_size=m.vocab_size, dtype=m.dtype,
                                 root=a.root, parent=a.parent) for a in self.frontend.adapter_cards()]
        return pb.ListModelsResponse(models=[card, *adapters])


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
_ALPHA = reflection_pb2.DESCRIPTOR.package  # grpc.reflection.v1alpha


def _reflection_v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc.reflection.v1's file, made from v1alpha's: the two protocols are the same
    messages under another package (grpcio-reflection ships only v1alpha)."""
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fdp.ClearField("options")
    for msg in fdp.message_type:
        for f in msg.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(f".{_ALPHA}.", ".grpc.reflection.v1.")
    for m in fdp.service[0].method:
        m.input_type = m.input_type.replace(f".{_ALPHA}.", ".grpc.reflection.v1.")
        m.output_type = m.output_type.replace(f".{_ALPHA}.", ".grpc.reflection.v1.")
    return fdp


def enable_reflection(server) -> None:
    """Server reflection, v1 (what grpcurl and current clients ask for first) and v1alpha,
    over a private pool that holds exactly the files this server serves."""
    pool = descriptor_pool.DescriptorPool()
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        fdp = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(fdp)
        pool.AddSerializedFile(fdp.SerializeToString())
    pool.AddSerializedFile(_reflection_v1_file().SerializeToString())
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    for service in (reflection.SERVICE_NAME, REFLECTION_V1):  # same wire format, two names
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)


class GrpcServer:
    """A grpc.aio server with the Inference, health and reflection services; TLS and API
    keys as `security` says."""

    def __init__(self, frontend: Surface, host: str, port: int, security: ServerSecurity | None = None):
        security = security or ServerSecurity()
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                      interceptors=[ApiKeyInterceptor(security)] if security.keys else None)
        add_inference_service(InferenceService(frontend, security), self.server)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server)
        creds = security.grpc_credentials()
        self.port = (self.server.add_secure_port(f"{host}:{port}", creds) if creds is not None
                     else self.server.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            res = self.health.set(name, status)
            if hasattr(res, "__await__"):
                await res

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.server.stop(grace_s)
