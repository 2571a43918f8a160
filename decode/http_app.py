"""OpenAI-compatible HTTP surface of a decode worker (FastAPI).

/v1/completions and /v1/chat/completions (SSE when ``stream``), /v1/models,
/health, /metrics. Errors use OpenAI's JSON shape with ``param`` naming the
field: 400 bad input (malformed JSON included), 429 QoS refusal (with
Retry-After and the predicted TTFT), 503 draining.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine import SamplingParams
from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, UINT64_MAX

from .frontend import Frontend
from .http_guard import BodyLimit, H11Protocol, openai_error
from .ingress import GenerateInput, RequestError

__all__ = ["build_app", "H11Protocol"]

log = logging.getLogger(__name__)

HTTP_STATUS = {"invalid_argument": 400, "resource_exhausted": 429, "unavailable": 503, "internal": 500}


class _Common(BaseModel):
    # OpenAI clients send fields we do not use (user, ...): ignore those, but
    # type-check every field we do use, strictly: `"max_tokens": true` or `"7"` is
    # refused, not coerced, and NaN / Infinity (which Python's JSON parser accepts)
    # are refused by name.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    # The ranges are the engine's (SamplingParams.validate), so the OpenAPI document
    # tells clients exactly what is accepted.
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    # pdserve extensions
    priority: Literal["high", "normal", "low"] = "normal"
    ttft_slo_ms: float | None = Field(None, gt=0)
    route: Literal["auto", "local", "remote"] = "auto"
    request_id: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9._:@/+=-]+$")

    def sampling(self, logprobs: int | None) -> SamplingParams:
        kw = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                            "presence_penalty", "frequency_penalty", "repetition_penalty")
              if getattr(self, k) is not None}
        return SamplingParams(**kw, logprobs=logprobs, stop=self.stop or [],
                              stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def _from_request_error(exc: RequestError) -> JSONResponse:
    headers = {}
    if exc.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, -(-exc.retry_after_ms // 1000)))
    if exc.predicted_ttft_ms is not None:
        headers["X-Predicted-TTFT-Ms"] = f"{exc.predicted_ttft_ms:.1f}"
    return openai_error(HTTP_STATUS[exc.code], str(exc), exc.field, headers)


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="pdserve decode worker", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=frontend.limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return openai_error(400, "body: malformed JSON", "body")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if not loc:  # the body itself is unusable (not JSON, or not a JSON object)
            return openai_error(400, f"body: malformed JSON or not a JSON object ({first.get('msg', '')})", "body")
        # The top-level field names the parameter; the rest of loc is the path inside it
        # (union members show as type names: "prompt", "str").
        field_name = loc[0]
        where = f" (at {'.'.join(loc)})" if len(loc) > 1 else ""
        return openai_error(400, f"{field_name}: {first.get('msg', 'invalid value')}{where}", field_name)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _from_request_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong
        # method) in the same OpenAI error shape as every other error.
        param = "body" if exc.status_code == 400 else None
        detail = f"body: {exc.detail}" if param else str(exc.detail)
        return openai_error(exc.status_code, detail, param, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        frontend.metrics.error("internal")
        return openai_error(500, f"internal error: {exc.__class__.__name__}: {exc}")

    async def run(inp: GenerateInput, stream: bool, kind: str):
        rid = inp.request_id or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        inp.request_id = rid
        created = int(time.time())
        gen = frontend.generate(inp)
        # Run validation / admission before answering, so errors get their status code.
        try:
            first = await gen.__anext__()
        except RequestError as exc:
            frontend.metrics.error(exc.code)
            return _from_request_error(exc)
        if stream:
            return StreamingResponse(_sse(rid, created, kind, first, gen), media_type="text/event-stream")
        chunks = [first]
        async for c in gen:
            chunks.append(c)
        return JSONResponse(_full(rid, created, kind, chunks))

    def _choice(kind: str, text: str, finish, delta: bool) -> dict:
        if kind == "chat":
            body = {"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}
            return {"index": 0, **body, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

    def _full(rid, created, kind, chunks) -> dict:
        last = chunks[-1]
        text = "".join(c.text for c in chunks)
        b = last.breakdown or {}
        n_out = sum(len(c.token_ids) for c in chunks)
        return {
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": frontend.served_model,
            "choices": [_choice(kind, text, last.finish_reason, False)],
            "usage": {"prompt_tokens": b.get("prompt_tokens", 0), "completion_tokens": n_out,
                      "total_tokens": b.get("prompt_tokens", 0) + n_out},
            "token_ids": [t for c in chunks for t in c.token_ids],
            "pdserve": b,
        }

    async def _sse(rid, created, kind, first, gen):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(c) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": frontend.served_model,
                       "choices": [_choice(kind, c.text, c.finish_reason, True)], "token_ids": c.token_ids}
            if c.breakdown is not None:
                payload["pdserve"] = c.breakdown
            return f"data: {json.dumps(payload)}\n\n"

        try:
            yield event(first)
            async for c in gen:
                yield event(c)
            yield "data: [DONE]\n\n"
        except RequestError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'param': exc.field}})}\n\n"
        finally:
            await gen.aclose()  # client gone: the frontend aborts the request

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        inp = GenerateInput(prompt=body.prompt, params=body.sampling(body.logprobs), request_id=body.request_id,
                            model=body.model, priority=body.priority, ttft_slo_ms=body.ttft_slo_ms, route=body.route)
        return await run(inp, body.stream, "completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        # The template is rendered and tokenized with the rest of validation, off the event loop.
        lp = (body.top_logprobs or 0) if body.logprobs else None
        inp = GenerateInput(prompt=None, messages=[m.model_dump() for m in body.messages],
                            params=body.sampling(lp), request_id=body.request_id, model=body.model,
                            priority=body.priority, ttft_slo_ms=body.ttft_slo_ms, route=body.route)
        return await run(inp, body.stream, "chat")

    @app.get("/v1/models")
    async def models():
        eng = frontend.engine.engine
        return {"object": "list", "data": [{"id": frontend.served_model, "object": "model", "owned_by": "pdserve",
                                            "max_model_len": eng.max_model_len}]}

    @app.get("/health")
    async def healthz():
        if not frontend.engine.alive:
            return openai_error(503, f"engine is not running: {frontend.engine.error!r}")
        if frontend.draining:
            return openai_error(503, "draining")
        return {"status": "ok", "worker_id": frontend.worker_id}

    @app.get("/metrics")
    async def metrics():
        frontend.refresh_gauges()
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
