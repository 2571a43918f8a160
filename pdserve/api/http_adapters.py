"""vLLM's LoRA adapter routes on the OpenAI HTTP app (api/http_app.py): ``POST
/v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}`` and ``POST
/v1/unload_lora_adapter`` ``{"lora_name": ...}``, over the `Surface`'s adapters
(api/adapters.py). Success is 200 with a line of text, as vLLM answers; a bad body or adapter
400 naming the field, an unknown adapter 404, an adapter still running requests 409. With API
keys on, only an operator key may call them (403 otherwise).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from .http_schema import response_docs
from .ingress import RequestError
from .surface import Surface

__all__ = ["add_adapter_routes", "LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest"]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, description="the name requests use as their model")
    lora_path: str = Field(min_length=1, description="the PEFT adapter directory on the worker's host")


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's; ignored (the name identifies the adapter)")


def _operator_only(request: Request, what: str) -> None:
    caller = getattr(request.state, "caller", None)
    if caller is not None and not caller.operator:
        raise RequestError("permission_denied", f"lora_name: {what} LoRA adapters needs an operator API key "
                           "(marked `operator` in the keys file)", "lora_name")


async def _body(request: Request, fields: tuple[str, ...]) -> dict:
    """The JSON object body, its string ``fields`` checked (RequestError naming the field)."""
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("invalid_argument", "body: malformed JSON", "body") from None
    if not isinstance(body, dict):
        raise RequestError("invalid_argument", "body: must be a JSON object", "body")
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise RequestError("invalid_argument", f"{name}: required, a non-empty string (got {value!r})", name)
    return body


def add_adapter_routes(app: FastAPI, frontend: Surface) -> None:
    docs = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **response_docs(400, 403, 404, 500)}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=docs,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": LoadLoRAAdapterRequest.model_json_schema()}}}})
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        _operator_only(request, "loading")
        body = await _body(request, ("lora_name", "lora_path"))
        await frontend.load_adapter(body["lora_name"], body["lora_path"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={**docs, **response_docs(409)},
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": UnloadLoRAAdapterRequest.model_json_schema()}}}})
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        _operator_only(request, "unloading")
        body = await _body(request, ("lora_name",))
        await frontend.unload_adapter(body["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
