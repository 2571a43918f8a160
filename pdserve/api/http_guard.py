"""What guards the HTTP surface before FastAPI sees a request, and the error shape it shares.

`BodyLimit` (ASGI middleware) refuses a body over the worker's limit with 413
before anything parses it; `H11Protocol` answers a request h11 cannot parse
with JSON in the same shape (431 for oversized headers instead of a bare
plain-text 400); `openai_error` builds OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``) used for every refusal.
"""

from __future__ import annotations

import http
import json

import h11
import uvicorn.protocols.http.h11_impl
from fastapi.responses import JSONResponse


def openai_error(status: int, message: str, param: str | None = None, headers: dict | None = None,
                 code: str | None = None) -> JSONResponse:
    """OpenAI's error JSON; ``code`` is the status (vLLM's habit) unless a string code is given
    (OpenAI's ``model_not_found`` for a model, or a LoRA adapter, not served here)."""
    kind = {429: "rate_limit_error", 503: "unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}},
                        status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before anything parses it.

    A declared Content-Length over the limit is refused at once; a chunked body
    is counted as it arrives and refused as soon as it passes the limit.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    return await send_json(send, openai_error(400, "Content-Length: not a number", "Content-Length"))
                if int(value) > self.max_bytes:
                    return await self._too_large(send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client gone
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        await send_json(send, openai_error(413, f"body: larger than this worker's limit of {self.max_bytes} bytes "
                                      "(limits.max_body_bytes)", "body"))


async def send_json(send, resp: JSONResponse) -> None:
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})


class H11Protocol(uvicorn.protocols.http.h11_impl.H11Protocol):
    """uvicorn's h11 protocol answering a bad request with h11's own status hint
    (431 for headers past the size limit) instead of a bare 400 for everything."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status = 400
        next_event = self.conn.next_event

        def next_event_noting_status():
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint
                raise

        self.conn.next_event = next_event_noting_status

    def send_400_response(self, msg: str) -> None:
        # Requests h11 cannot parse never reach FastAPI: answer them in the same OpenAI
        # error shape as everything else (uvicorn's default is a plain-text 400).
        status = self._error_status
        msg = "request headers too large" if status == 431 else msg
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "param": None,
                                     "code": status}}).encode()
        for event in (h11.Response(status_code=status, reason=http.HTTPStatus(status).phrase.encode(),
                                   headers=[(b"content-type", b"application/json"), (b"connection", b"close"),
                                            (b"content-length", str(len(body)).encode())]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
