"""OpenAI-compatible HTTP surface of a decode worker or a gateway (FastAPI), over its `Surface`.

/v1/completions and /v1/chat/completions (server-sent events when ``stream``),
/v1/models, /health, /metrics (Prometheus text). Request and response models
are `pdserve.api.openai_types`, built with this worker's bounds, so
/openapi.json describes exactly what the worker accepts and answers. Every
error has OpenAI's JSON shape with ``param`` naming the field: 400 bad input
(malformed JSON included), 404 unknown model or path, 413 body too large, 429
QoS refusal (with Retry-After and the predicted TTFT), 503 draining or engine
down, 500 a bug. With API keys (api/security.py): 401 without a valid key
(except on the open paths), 403 for a privilege the key lacks; /openapi.json then
declares the bearer scheme. One generation call is answered by api/http_generation.py.
"""

import functools
import inspect
import logging
import time
from typing import Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.api.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ErrorResponse,
    Health,
    ModelList,
)
from pdserve.api.openai_structured import structured_outputs_of
from pdserve.api.openai_types import Bounds, ChatFields, CompletionFields, RequestModels, SamplingFields, request_models
from pdserve.engine import SamplingParams
from pdserve.engine.request import INT64_MAX, INT64_MIN, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, UINT64_MAX

from .http_adapters import add_adapter_routes
from .http_generation import Generation, from_request_error
from .http_guard import BodyLimit, H11Protocol, openai_error
from .http_schema import ERRORS, field_names, generation_responses, param_of, response_docs
from .ingress import GenerateInput, RequestError
from .security import ApiKeyAuth, ServerSecurity
from .surface import Surface
from .tool_calls import ChatOptions, plan_tools, template_messages

__all__ = ["build_app", "bounds_of", "H11Protocol"]

log = logging.getLogger(__name__)

def bounds_of(frontend: Surface) -> Bounds:
    """This worker's bounds: the model's context and vocabulary, its limits, the engine's ranges."""
    card, lim = frontend.model_card(), frontend.limits
    return Bounds(
        max_model_len=card.max_model_len, vocab_size=card.vocab_size,
        max_prompt_chars=frontend.max_prompt_chars, max_request_id_chars=lim.max_request_id_chars,
        max_messages=lim.max_messages, max_stop_strings=lim.max_stop_strings, max_stop_chars=lim.max_stop_chars,
        max_stop_token_ids=lim.max_stop_token_ids, max_n=lim.max_n, max_prompts=lim.max_prompts,
        max_temperature=MAX_TEMPERATURE, max_repetition_penalty=MAX_REPETITION_PENALTY,
        seed_min=INT64_MIN, seed_max=UINT64_MAX, int64_max=INT64_MAX, max_logit_bias=lim.request.max_logit_bias,
        max_bad_words=lim.request.max_bad_words, max_allowed_token_ids=lim.request.max_allowed_token_ids)


def build_app(frontend: Surface, security: ServerSecurity | None = None, chat: ChatOptions | None = None) -> FastAPI:
    """The OpenAI-compatible HTTP app over ``frontend`` (a decode worker's or a gateway's);
    ``chat``: how chat output is read (tool-call and reasoning parsers; api/tool_calls.py)."""
    security = security or ServerSecurity()
    models = request_models(bounds_of(frontend))
    app = FastAPI(title="pdserve decode worker", version="v1", docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of one pdserve decode worker (reference: docs/api.md).")
    app.add_middleware(BodyLimit, max_bytes=frontend.limits.max_body_bytes)
    app.add_middleware(ApiKeyAuth, security=security)  # outermost: no key, no body read
    _add_error_handlers(app, frontend, field_names(models.completion) | field_names(models.chat))
    _add_generation_routes(app, Generation(frontend, chat or ChatOptions()), models)
    _add_info_routes(app, frontend)
    app.openapi = functools.partial(_openapi, app, models, security)
    return app


def _add_error_handlers(app: FastAPI, frontend: Surface, known_fields: set[str]) -> None:
    """Every refusal and failure in OpenAI's error shape, ``param`` naming the field."""

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
        return from_request_error(exc)

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


_PASSED = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_p", "min_tokens", "allowed_token_ids", "prompt_logprobs")


def _input(body: SamplingFields, prompt: str | list[int] | None, messages: list[dict] | None = None,
           max_tokens: int | None = None, fill_context: bool = False, logprobs: int | None = None,
           prompt_logprobs: int | None = None) -> GenerateInput:
    """One prompt of a request as the `Surface` takes it; ``max_tokens``: the request's (either name);
    ``prompt_logprobs``: in place of the request's (a completion's echo with logprobs)."""
    kw = {k: getattr(body, k) for k in _PASSED if getattr(body, k) is not None}
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = prompt_logprobs
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    elif fill_context and body.min_tokens:
        # Checked against the default max_tokens before the context's room replaces it (api/validate.py)
        kw["max_tokens"] = max(SamplingParams.max_tokens, body.min_tokens)
    if body.min_tokens:
        # More than max_tokens means "all max_tokens" (the schema cannot compare two fields)
        kw["min_tokens"] = min(body.min_tokens, kw.get("max_tokens", SamplingParams.max_tokens))
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    params = SamplingParams(**kw, logprobs=logprobs, stop=stop, stop_token_ids=body.stop_token_ids or [],
                            ignore_eos=body.ignore_eos, logit_bias=body.logit_bias or None,
                            bad_words=body.bad_words or [], structured_outputs=structured_outputs_of(body))
    return GenerateInput(prompt=prompt, messages=messages, params=params, model=body.model,
                         priority=body.priority, ttft_slo_ms=body.ttft_slo_ms, route=body.route,
                         fill_context=fill_context and max_tokens is None)


def _check_combinations(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError("invalid_argument", "stream_options: only with stream: true", "stream_options")
    structured_outputs_of(body)  # one constraint at most, a known backend (a RequestError names the field)


def _prompts(p: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion's prompts: one text or list of token ids, or a list of either (the model
    checked that a list holds one kind)."""
    if isinstance(p, str):
        return [p]
    ids = [x for x in p if isinstance(x, int)]
    return [ids] if ids else [x for x in p if not isinstance(x, int)]


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Response]])


def _with_body(handler: Handler, model: type[BaseModel]) -> Handler:
    """``handler`` with its ``body`` parameter declared as ``model``. FastAPI reads the body's
    model from the signature; this worker's models are built at run time (`request_models`),
    so the checker sees the handler typed by the fields they have (openai_types' Protocols)."""
    sig = inspect.signature(handler)
    params = [p.replace(annotation=model) if p.name == "body" else p for p in sig.parameters.values()]
    setattr(handler, "__signature__", sig.replace(parameters=params))
    return handler


def _add_generation_routes(app: FastAPI, gen: Generation, models: RequestModels) -> None:
    async def completions(body: CompletionFields, request: Request) -> Response:
        _check_combinations(body)
        prompts = _prompts(body.prompt)
        # echo with logprobs: the prompt's tokens' logprobs too (vLLM: prompt_logprobs defaults to logprobs)
        echo_lps = body.logprobs if body.echo and body.prompt_logprobs is None else None
        return await gen.run(request, body, "completion",
                             [_input(body, q, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                     prompt_logprobs=echo_lps) for q in prompts],
                             body.logprobs, prompts if body.echo else None)

    async def chat(body: ChatFields, request: Request) -> Response:
        _check_combinations(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("invalid_argument", "top_logprobs: needs logprobs: true", "top_logprobs")
        plan = plan_tools(body, gen.chat)  # tools and tool_choice (api/tool_calls.py)
        # developer is OpenAI's newer name for system; text parts are joined with newlines.
        messages = template_messages(body.messages)
        lp = (body.top_logprobs or 0) if body.logprobs else None
        # The template is rendered and tokenized with the rest of validation, off the event loop.
        max_tokens = body.max_completion_tokens or body.max_tokens
        inp = _input(body, None, messages, max_tokens, fill_context=True, logprobs=lp)
        plan.apply(inp, body)  # the tools for the template; required or a named function: the calls' grammar
        return await gen.run(request, body, "chat", [inp], lp, shaper=plan.shaper(gen.chat), renames=plan.renames)

    app.post("/v1/completions", response_model=None, responses=generation_responses(Completion, CompletionChunk))(
        _with_body(completions, models.completion))
    app.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletion, ChatCompletionChunk))(_with_body(chat, models.chat))


def _add_info_routes(app: FastAPI, frontend: Surface) -> None:
    started = int(time.time())

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **response_docs(500)})
    async def list_models():
        card = frontend.model_card()
        data = [{"id": card.id, "object": "model", "created": started, "owned_by": "pdserve",
                 "max_model_len": card.max_model_len}]
        # vLLM lists each LoRA adapter too: root its directory, parent the base model
        data += [{"id": a.id, "object": "model", "created": started, "owned_by": "pdserve",
                  "max_model_len": card.max_model_len, "root": a.root, "parent": a.parent}
                 for a in frontend.adapter_cards()]
        return {"object": "list", "data": data}

    if frontend.adapters is not None:  # (vLLM too serves them only where adapters can be loaded)
        add_adapter_routes(app, frontend)

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


def _openapi(app: FastAPI, models: RequestModels, security: ServerSecurity) -> dict:
    """The app's OpenAPI document, made once: its errors in OpenAI's shape, the request
    schemas as pydantic writes them, the bearer scheme when API keys are on."""
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
            [(models.completion, "validation"), (models.chat, "validation")]
            + [(m, "serialization") for m in (Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk,
                                              ErrorResponse, ModelList, Health)],
            ref_template="#/components/schemas/{model}")
        schemas.update(defs["$defs"])
        if security.keys is not None:
            _document_api_keys(doc, security.open_paths, error)
        app.openapi_schema = doc
    return app.openapi_schema


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


def forget_http_endpoints() -> None:
    """Clear FastAPI's process-wide caches of the callables it inspected (fastapi/dependencies/
    models.py, 4096 entries each, in the releases that have them). They hold every endpoint
    strongly, and the HTTP app's endpoints close over the frontend, so a stopped worker's engine
    (weights and KV pool), or a gateway's frontend, lived as long as the process: ~330 MiB per
    worker in a test run. Apps still serving in this process just inspect their endpoints again."""
    from fastapi.dependencies import models

    for value in vars(models).values():
        if isinstance(value, functools._lru_cache_wrapper):
            value.cache_clear()
