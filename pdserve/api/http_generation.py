"""One call of /v1/completions or /v1/chat/completions on the `Surface`, answered as OpenAI's JSON
or as server-sent events (`Generation`; the routes that parse the requests are api/http_app.py):
every sequence validated and admitted before the first byte, so a refusal gets its status code
(`from_request_error`); a client that leaves stops its work; a chat choice's text read into
reasoning, content and tool calls when the request asks for it (api/tool_calls.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from typing import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.common import jsonlog
from pdserve.common.tracing import carrier_of, trace_id_of

from .disconnect import ClientWatch
from .http_guard import openai_error
from .ingress import Chunk, GenerateInput, RequestError
from .openai_reply import Reply, merge_choice, usage_of
from .openai_structured import param_names
from .openai_types import SamplingFields
from .surface import Surface
from .tool_calls import ChatOptions, ChoiceShaper

__all__ = ["Generation", "from_request_error", "HTTP_STATUS"]

log = logging.getLogger(__name__)

HTTP_STATUS = {"invalid_argument": 400, "not_found": 404, "already_exists": 409, "resource_exhausted": 429,
               "unavailable": 503, "internal": 500, "permission_denied": 403}


def from_request_error(exc: RequestError) -> JSONResponse:
    headers = {}
    if exc.retry_after_ms is not None:
        # Retry-After counts whole seconds; retry-after-ms is the exact hint, which the OpenAI SDKs
        # read first (a 300 ms hint otherwise makes them wait a whole second).
        headers["Retry-After"] = str(max(1, -(-exc.retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(max(1, int(exc.retry_after_ms)))
    if exc.predicted_ttft_ms is not None:
        headers["X-Predicted-TTFT-Ms"] = f"{exc.predicted_ttft_ms:.1f}"
    code = "model_not_found" if exc.code == "not_found" and exc.field == "model" else None  # OpenAI's
    return openai_error(HTTP_STATUS[exc.code], str(exc), exc.field, headers, code)


def _token_text_of(tokenizer) -> Callable[[int], str]:
    """A token's text as it reads inside a sequence (cached): decoded after an anchor, because
    SentencePiece-style decoders drop a leading space at the start of a sequence."""
    anchor = tokenizer.encode("a", add_special_tokens=False)
    anchor_text = tokenizer.decode(anchor, skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        text = tokenizer.decode(anchor + [token_id], skip_special_tokens=False)
        if text.startswith(anchor_text):
            return text[len(anchor_text):]
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return token_text


Choices = AsyncGenerator[tuple[int, Chunk], None]


class Generation:
    """One call of either generation route: its sequences run on the `Surface`, answered
    whole (JSON) or streamed (server-sent events)."""

    def __init__(self, frontend: Surface, chat: ChatOptions):
        self.frontend = frontend
        self.chat = chat
        self.token_text = _token_text_of(frontend.tokenizer)

    async def run(self, request: Request, body: SamplingFields, kind: str, inputs: list[GenerateInput],
                  logprobs: int | None, echo: list[str | list[int]] | None = None,
                  shaper: Callable[[], ChoiceShaper] | None = None, renames: dict[str, str] | None = None) -> Response:
        """``echo``: the prompts to prepend to each choice's text (completions' echo); ``shaper``:
        reads each chat choice's reasoning and tool calls; ``renames``: the request fields the
        engine's errors are about, beyond the structured-output ones (a tool's schema)."""
        frontend = self.frontend
        rid = body.request_id or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        caller = getattr(request.state, "caller", None)  # ApiKeyAuth's: the key, or keys off the client
        trace = carrier_of(request.headers.items())  # W3C traceparent / tracestate
        jsonlog.bind(rid, trace_id_of(trace))  # this call's log lines name them
        for inp in inputs:
            inp.request_id = rid
            inp.caller = caller
            inp.trace = trace
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
                # as the client spelled it
                return from_request_error(exc.renamed({**param_names(body), **(renames or {})}))
            texts = [] if echo is None else [p if isinstance(p, str) else await frontend.detokenize(p) for p in echo]
            reply = Reply(kind, rid, frontend.served_model, self.token_text, logprobs,
                          [texts[i // n] for i in range(len(inputs) * n)] if texts else [], shaper)
            if body.stream:
                if watch.close():
                    return _client_gone(rid)
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(self._sse(reply, len(inputs) * n, n, usage, first, gen),
                                         media_type="text/event-stream")
            pieces: dict[int, list[dict]] = {}
            seen = [first]
            pieces.setdefault(first[0], []).append(reply.choice(first[0], first[1], stream=False))
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
        out = reply.envelope([reply.shaped(merge_choice(pieces[i])) for i in sorted(pieces)], stream=False)
        out["usage"] = usage_of(seen, n)
        return JSONResponse(out)

    async def _sse(self, reply: Reply, num_choices: int, n: int, include_usage: bool, first: tuple[int, Chunk],
                   gen: Choices) -> AsyncIterator[str]:
        frontend = self.frontend
        seen = []

        def event(choices: list[dict], usage: dict | None = None) -> str:
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
            yield event([reply.choice(first[0], first[1], stream=True)])
            async for i, c in gen:
                seen.append((i, c))
                yield event([reply.choice(i, c, stream=True)])
            if include_usage:
                yield event([], usage_of(seen, n))
        except RequestError as exc:
            frontend.metrics.error(exc.code)
            yield f"data: {from_request_error(exc).body.decode()}\n\n"
        except Exception as exc:  # noqa: BLE001  (a bug after the 200: the client still gets an error event)
            log.exception("stream %s failed", reply.rid)
            frontend.metrics.error("internal")
            yield f"data: {openai_error(500, f'internal error: {exc.__class__.__name__}: {exc}').body.decode()}\n\n"
        finally:
            await gen.aclose()  # client gone: the frontend aborts every sequence
        yield "data: [DONE]\n\n"


def _client_gone(rid: str) -> Response:
    """What a handler returns for a client that left (nobody reads it): its sequences were
    aborted where they waited, and the generator is closed by the handler's finally."""
    log.debug("request %s: client gone before the response; its sequences were aborted", rid)
    return Response(status_code=499)
