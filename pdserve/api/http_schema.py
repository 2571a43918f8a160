"""What /openapi.json says about responses, and how a validation error names its field.

`response_docs` / `generation_responses` describe the error statuses and the
server-sent event stream (OpenAPI 3.1: the schema is of one event); `param_of`
turns a pydantic error location into the parameter name OpenAI clients expect
("messages[0].content").
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from pdserve.api.openai_responses import ErrorResponse

ERRORS = {
    400: "a field is invalid (`param` names it), the body is not a JSON object, or prompt + max_tokens "
         "exceed max_model_len",
    401: "no valid API key: send `Authorization: Bearer <API key>` (only when the worker has API keys)",
    403: "`route` other than auto, or `priority: high`, needs an operator API key (`param` names the field)",
    404: "`model` is not served here (`param` is model), or an unknown path",
    409: "`request_id` names a request of the same API key still in flight on this worker",
    413: "the body is over this worker's limits.max_body_bytes",
    429: "refused by QoS admission: Retry-After and X-Predicted-TTFT-Ms say when to retry",
    500: "a bug in this worker; the request was not served",
    503: "the worker is draining or its engine is down: retry on another decode worker",
}
SSE_NOTE = ("With `stream: true`: server-sent events, one `data: <{chunk} JSON>` per event (see the {chunk} "
            "schema), then `data: [DONE]`. An error after the stream began is one `data: <ErrorResponse JSON>`.")



def response_docs(*codes: int) -> dict:
    return {c: {"model": ErrorResponse, "description": ERRORS[c]} for c in codes}


def sse_event(chunk) -> dict:
    """One server-sent event, as OpenAPI 3.1 describes an event stream (the schema is of
    each event): its data is a chunk, an error, or the last event's [DONE]."""
    json_data = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}
    return {"type": "object", "required": ["data"], "description": SSE_NOTE.format(chunk=chunk.__name__),
            "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                           "data": {"type": "string", "if": {"not": {"const": "[DONE]"}}, "then": json_data}}}


def generation_responses(model, chunk) -> dict:
    sse = {"schema": sse_event(chunk)}
    return {200: {"model": model, "description": "the completion (JSON), or its stream (server-sent events)",
                  "content": {"text/event-stream": sse}},
            **response_docs(400, 404, 409, 413, 429, 500, 503)}


def field_names(model) -> set[str]:
    """Every field name in a request model's tree."""
    names: set[str] = set()
    todo = [model]
    while todo:
        m = todo.pop()
        for name, info in m.model_fields.items():
            names.add(info.alias or name)  # as the client spells it ("json", not "json_")
            todo.extend(t for t in models_in(info.annotation) if t not in todo)
    return names


def models_in(annotation) -> list:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in models_in(a)]


def param_of(loc: list, field_names: set[str]) -> str:
    """The parameter a validation error is about, as OpenAI names nested ones
    ("messages[0].content"): pydantic's union-member tags ("constrained-str",
    "list[int]") are dropped, and so is an index into a list of plain values (the
    message says which element)."""
    parts: list[str] = []
    for k, part in enumerate(loc):
        if isinstance(part, int):
            if any(isinstance(p, str) and p in field_names for p in loc[k + 1:]):
                parts.append(f"[{part}]")
        elif part in field_names:
            parts.append(f".{part}" if parts else part)
    return "".join(parts) or str(loc[0])
