"""OpenAI-compatible HTTP surface of a decode worker (FastAPI).

/v1/completions and /v1/chat/completions (server-sent events when ``stream``),
/v1/models, /health, /metrics (Prometheus text). Request and response models
are `pdserve.api.openai_types`, built with this worker's bounds, so
/openapi.json describes exactly what the worker accepts and answers. Every
error has OpenAI's JSON shape with ``param`` naming the field: 400 bad input
(malformed JSON included), 404 unknown model or path, 413 body too large, 429
QoS refusal (with Retry-After and the predicted TTFT), 503 draining or engine
down, 500 a bug. With API keys (decode/security.py): 401 without a valid key
(except on the open paths), 403 for a privilege the key lacks; /openapi.json then
declares the bearer scheme.
"""

import asyncio
import functools
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.openai_reply import Reply, merge_choice, usage_of
from pdserve.api.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorResponse,
    Health,
    ModelList,
)
from pdserve.api.openai_types import Bounds, request_models
from pdserve.engine import SamplingParams
from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, UINT64_MAX

from .disconnect import ClientWatch
from .http_guard import BodyLimit, H11Protocol, openai_error
from .http_schema import ERRORS, field_names, generation_responses, param_of, response_docs
from .ingress import GenerateInput, RequestError
from .security import ApiKeyAuth, ServerSecurity
from .surface import Surface

__all__ = ["build_app", "bounds_of", "H11Protocol"]

log = logging.getLogger(__name__)

HTTP_STATUS = {"invalid_argument": 400, "not_found": 404, "already_exists": 409, "resource_exhausted": 429,
               "unavailable": 503, "internal": 500, "permission_denied": 403}

def bounds_of(frontend: Surface) -> Bounds:
    """This worker's bounds: the model's context and vocabulary, its limits, the engine's ranges."""
    card, lim = frontend.model_card(), frontend.limits
    return Bounds(
        max_model_len=card.max_model_len, vocab_size=card.vocab_size,
        max_prompt_chars=frontend.max_prompt_chars, max_request_id_chars=lim.max_request_id_chars,
        max_messages=lim.max_messages, max_stop_strings=lim.max_stop_strings, max_stop_chars=lim.max_stop_chars,
        max_stop_token_ids=lim.max_stop_token_ids, max_n=lim.max_n, max_prompts=lim.max_prompts,
        max_temperature=MAX_TEMPERATURE, max_repetition_penalty=MAX_REPETITION_PENALTY,
        seed_min=INT64_MIN, seed_max=UINT64_MAX, int64_max=INT64_MAX)


def _from_request_error(exc: RequestError) -> JSONResponse:
    headers = {}
    if exc.retry_after_ms is not None:
        # Retry-After counts whole seconds; retry-after-ms is the exact hint, which the OpenAI SDKs
        # read first (a 300 ms hint otherwise makes them wait a whole second).
        headers["Retry-After"] = str(max(1, -(-exc.retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(max(1, int(exc.retry_after_ms)))
    if exc.predicted_ttft_ms is not None:
        headers["X-Predicted-TTFT-Ms"] = f"{exc.predicted_ttft_ms:.1f}"
    return openai_error(HTTP_STATUS[exc.code], str(exc), exc.field, headers)


def build_app(frontend: Surface, security: ServerSecurity | None = None) -> FastAPI:
    security = security or ServerSecurity()
    models = request_models(bounds_of(frontend))
    CompletionRequest, ChatRequest = models.completion, models.chat
    app = FastAPI(title="pdserve decode worker", version="v1", docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of one pdserve decode worker (reference: docs/api.md).")
    app.add_middleware(BodyLimit, max_bytes=frontend.limits.max_body_bytes)
    app.add_middleware(ApiKeyAuth, security=security)  # outermost: no key, no body read
    known_fields = field_names(CompletionRequest) | field_names(ChatRequest)
    started = int(time.time())

    tokenizer = frontend.tokenizer
    anchor = tokenizer.encode("a", add_special_tokens=False)
    anchor_text = tokenizer.decode(anchor, skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        """A token's text as it reads inside a sequence: decoded after an anchor, because
        SentencePiece-style decoders drop a leading space at the start of a sequence."""
        text = tokenizer.decode(anchor + [token_id], skip_special_tokens=False)
        if text.startswith(anchor_text):
            return text[len(anchor_text):]
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return openai_error(400, "body: malformed JSON", "body")
        # A union field reports one error per member: the member that got furthest says
        # what is wrong ([1, true] as a prompt: "prompt[1] should be an integer").
        same = [e for e in errs if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
        first = max(same or [first], key=lambda e: (len(e.get("loc", ())), not e.get("type", "").endswith("_type")))
        loc = list(first.get("loc", ()))[1:]  # after "body"
        if not loc:  # the body itself is unusable (not JSON, or not a JSON object)
            return openai_error(400, f"body: malformed JSON or not a JSON object ({first.get('msg', '')})", "body")
        param = param_of(loc, known_fields)
        where = ".".join(map(str, loc))
        where = f" (at {where})" if where != param else ""
        return openai_error(400, f"{param}: {first.get('msg', 'invalid value')}{where}", param)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        frontend.metrics.error(exc.code)
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

    async def run(request: Request, body, kind: str, inputs: list[GenerateInput], logprobs: int | None):
        rid = body.request_id or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        caller = getattr(request.state, "caller", None)  # ApiKeyAuth's: the key, or keys off the client
        for inp in inputs:
            inp.request_id = rid
            inp.caller = caller
        n = body.n
        gen = frontend.generate_many(inputs, n)
        watch = ClientWatch(request.receive)  # until the response starts: a client that leaves stops its work
        try:
            # Validation and admission of every sequence happen before the first chunk, so
            # errors get their status code.
            try:
                first = await gen.__anext__()
            except RequestError as exc:
                frontend.metrics.error(exc.code)
                return _from_request_error(exc)
            echo = []
            if getattr(body, "echo", False):
                texts = [p if isinstance(p, str) else await frontend.detokenize(p)
                         for p in (i.prompt for i in inputs)]
                echo = [texts[i // n] for i in range(len(inputs) * n)]
            reply = Reply(kind, rid, frontend.served_model, token_text, logprobs, echo)
            if body.stream:
                if watch.close():
                    return _client_gone(rid)
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(_sse(reply, len(inputs) * n, n, usage, first, gen),
                                         media_type="text/event-stream")
            pieces: dict[int, list[dict]] = {}
            seen = [first]
            pieces.setdefault(first[0], []).append(reply.choice(*first, stream=False))
            async for i, c in gen:
                seen.append((i, c))
                pieces.setdefault(i, []).append(reply.choice(i, c, stream=False))
        except asyncio.CancelledError:
            if not watch.gone():
                raise
            return _client_gone(rid)
        finally:
            if watch.close() or not body.stream:
                await gen.aclose()  # ends every sequence still running (none when it completed)
        out = reply.envelope([merge_choice(pieces[i]) for i in sorted(pieces)], stream=False)
        out["usage"] = usage_of(seen, n)
        return JSONResponse(out)

    async def _sse(reply: Reply, num_choices: int, n: int, include_usage: bool, first, gen):
        seen = []

        def event(choices: list[dict], usage=None) -> str:
            payload = reply.envelope(choices, stream=True)
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload, allow_nan=False)}\n\n"

        try:
            if reply.kind == "chat":  # OpenAI's first delta of each choice: the role, no content yet
                for i in range(num_choices):
                    yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None, "token_ids": []}])
            seen.append(first)
            yield event([reply.choice(*first, stream=True)])
            async for i, c in gen:
                seen.append((i, c))
                yield event([reply.choice(i, c, stream=True)])
            if include_usage:
                yield event([], usage_of(seen, n))
        except RequestError as exc:
            frontend.metrics.error(exc.code)
            yield f"data: {_from_request_error(exc).body.decode()}\n\n"
        except Exception as exc:  # noqa: BLE001  (a bug after the 200: the client still gets an error event)
            log.exception("stream %s failed", reply.rid)
            frontend.metrics.error("internal")
            yield f"data: {openai_error(500, f'internal error: {exc.__class__.__name__}: {exc}').body.decode()}\n\n"
        finally:
            await gen.aclose()  # client gone: the frontend aborts every sequence
        yield "data: [DONE]\n\n"

    def common(body, prompt, messages=None, fill_context=False, logprobs=None) -> GenerateInput:
        kw = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty") if getattr(body, k) is not None}
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        params = SamplingParams(**kw, logprobs=logprobs, stop=stop, stop_token_ids=body.stop_token_ids or [],
                                ignore_eos=body.ignore_eos)
        return GenerateInput(prompt=prompt, messages=messages, params=params, model=body.model,
                             priority=body.priority, ttft_slo_ms=body.ttft_slo_ms, route=body.route,
                             fill_context=fill_context and max_tokens is None)

    def check_combinations(body) -> None:
        if body.stream_options is not None and not body.stream:
            raise RequestError("invalid_argument", "stream_options: only with stream: true", "stream_options")

    @app.post("/v1/completions", response_model=None, responses=generation_responses(Completion, CompletionChunk))
    async def completions(body: CompletionRequest, request: Request):
        check_combinations(body)
        if body.echo and body.logprobs is not None:
            raise RequestError("invalid_argument", "echo: not with logprobs (prompt logprobs are not computed "
                               "here); drop one of them", "echo")
        p = body.prompt
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else p
        return await run(request, body, "completion", [common(body, q, logprobs=body.logprobs) for q in prompts],
                         body.logprobs)

    @app.post("/v1/chat/completions", response_model=None,
              responses=generation_responses(ChatCompletion, ChatCompletionChunk))
    async def chat(body: ChatRequest, request: Request):
        check_combinations(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("invalid_argument", "top_logprobs: needs logprobs: true", "top_logprobs")
        # developer is OpenAI's newer name for system; text parts are joined with newlines.
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "\n".join(x.text for x in m.content)}
                    for m in body.messages]
        lp = (body.top_logprobs or 0) if body.logprobs else None
        # The template is rendered and tokenized with the rest of validation, off the event loop.
        return await run(request, body, "chat", [common(body, None, messages, fill_context=True, logprobs=lp)], lp)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **response_docs(500)})
    async def list_models():
        card = frontend.model_card()
        return {"object": "list", "data": [{"id": card.id, "object": "model", "created": started,
                                            "owned_by": "pdserve", "max_model_len": card.max_model_len}]}

    @app.get("/health", response_model=None, responses={200: {"model": Health}, **response_docs(500, 503)})
    async def healthz():
        problem = frontend.health()
        if problem is not None:
            return openai_error(503, problem)
        return {"status": "ok", "worker_id": frontend.worker_id}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format 0.0.4"}, **response_docs(500)})
    async def metrics():
        frontend.refresh_gauges()
        return PlainTextResponse(frontend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for path, ops in doc["paths"].items():
                for op in ops.values():
                    # FastAPI documents 422 for every body; this server answers 400 instead.
                    op["responses"].pop("422", None)
                    for status, resp in op["responses"].items():
                        if int(status) >= 400:
                            resp["content"] = error
            doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {
                "type": "string"}}}
            # The schemas as pydantic writes them (FastAPI's own pass turns integer bounds into
            # floats, which loses 2**64 - 1), and the stream's events, which the
            # text/event-stream responses refer to by name.
            schemas = doc["components"]["schemas"]
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _, defs = models_json_schema(
                [(CompletionRequest, "validation"), (ChatRequest, "validation")]
                + [(m, "serialization") for m in (Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk,
                                                  ErrorResponse, ModelList, Health)],
                ref_template="#/components/schemas/{model}")
            schemas.update(defs["$defs"])
            if security.keys is not None:
                _document_api_keys(doc, security.open_paths, error)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


def _client_gone(rid: str) -> Response:
    """What a handler returns for a client that left (nobody reads it): its sequences were
    aborted where they waited, and the generator is closed by the handler's finally."""
    log.debug("request %s: client gone before the response; its sequences were aborted", rid)
    return Response(status_code=499)


def _document_api_keys(doc: dict, open_paths, error_content: dict) -> None:
    """The bearer scheme on every operation but the open paths', with its 401 (and 403
    where privileged fields exist)."""
    doc["components"]["securitySchemes"] = {"bearer": {
        "type": "http", "scheme": "bearer",
        "description": "an API key from this cluster's keys file (docs/security.md)"}}
    for path, ops in doc["paths"].items():
        if path in open_paths:
            continue
        for op in ops.values():
            op["security"] = [{"bearer": []}]
            codes = (401, 403) if "requestBody" in op else (401,)
            for code in codes:
                op["responses"][str(code)] = {"description": ERRORS[code], "content": error_content}
            op["responses"] = dict(sorted(op["responses"].items()))
