"""A process's log lines as text (the default) or as JSON objects, one a line (`--log-format
json`, docs/cluster.md "Logs"), each with the request id and trace id of the request it is
about where that is known.

The request path binds them (`bind`) in the context of the request's task: the gRPC and
HTTP handlers bind the client's request id and the trace id its ``traceparent`` names, and a
worker's request span, when it traces, binds its own trace id. Log calls made in that task
(the frontend's, the gateway's, uvicorn's access line) carry them. Context variables do not
cross into other threads (the engine thread, a prefill worker's batch thread), so the request
path also files the ids under the request's engine id (`track`, `untrack`), and a line about
one request there names them with ``extra=jsonlog.about(engine_id)``.

A JSON line: ``{"ts": "2026-...Z", "level": "INFO", "logger": "pdserve.gateway.frontend",
"message": "...", "request_id": "...", "trace_id": "...", "process": 1234, "thread": "..."}``,
plus ``exc_info`` (the traceback) when there is one, and an access line's ``http`` fields
(client, method, path, version, status) as uvicorn gives them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_trace_id", default=None)

_ACCESS_FIELDS = ("client", "method", "path", "version", "status")


def bind(request_id: str | None = None, trace_id: str | None = None) -> None:
    """The request (and trace) the current task's log lines are about from here on (None:
    left as it is)."""
    if request_id is not None:
        REQUEST_ID.set(request_id)
    if trace_id is not None:
        TRACE_ID.set(trace_id)


# Engine id -> (request id, trace id) of the requests in flight (`track`), and of the last
# RECENTLY_ENDED ones (a line about a request may come from the engine thread after its stream
# ended: its abort, its blocks freed).
RECENTLY_ENDED = 1024
_live: dict[str, tuple[str | None, str | None]] = {}
_ended: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
_ids_lock = threading.Lock()


def track(engine_id: str, request_id: str | None = None, trace_id: str | None = None) -> None:
    """File the ids of the request the engine knows as ``engine_id`` (None: those bound in the
    current context), for lines about it on other threads (`about`); `untrack` when it ends."""
    ids = (request_id if request_id is not None else REQUEST_ID.get(),
           trace_id if trace_id is not None else TRACE_ID.get())
    with _ids_lock:
        _ended.pop(engine_id, None)
        _live[engine_id] = ids


def untrack(engine_id: str) -> None:
    """The request is over: its ids stay known for the next RECENTLY_ENDED requests that end."""
    with _ids_lock:
        ids = _live.pop(engine_id, None)
        if ids is not None:
            _ended[engine_id] = ids
            while len(_ended) > RECENTLY_ENDED:
                _ended.popitem(last=False)


def about(engine_id: str) -> dict[str, str]:
    """The ``extra`` of a log line about the request the engine knows as ``engine_id``: its
    request id and trace id as `track` filed them (an id never filed: itself as the request id)."""
    with _ids_lock:
        ids = _live.get(engine_id) or _ended.get(engine_id)
    if ids is None:
        return {"request_id": engine_id}
    out = {"request_id": ids[0] or engine_id}
    if ids[1] is not None:
        out["trace_id"] = ids[1]
    return out


class RequestContext(logging.Filter):
    """Copies the bound request id and trace id onto each record (``request_id``, ``trace_id``),
    so that any formatter can print them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        if getattr(record, "trace_id", None) is None:
            record.trace_id = TRACE_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            value = getattr(record, key, None)
            if value is None:
                value = (REQUEST_ID if key == "request_id" else TRACE_ID).get()
            if value is not None:
                out[key] = value
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out["http"] = dict(zip(_ACCESS_FIELDS, record.args))  # uvicorn's (client, method, path, version, status)
        out["process"], out["thread"] = record.process, record.threadName
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def check_format(fmt: str, setting: str = "--log-format") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{setting}: one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def setup(fmt: str = "text", level: int | str = logging.INFO, stream: Any = None) -> logging.Handler:
    """The root logger writes to ``stream`` (stderr) in ``fmt``: its handlers are replaced by
    one; uvicorn's loggers hand their lines to it (`uvicorn_config`). Returns the handler."""
    check_format(fmt)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestContext())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def uvicorn_config(app: Any, log_format: str = "text", access_log: bool = True, **kwargs: Any) -> Any:
    """A uvicorn.Config for a worker's or gateway's HTTP surface: uvicorn's own lines at warning
    and above, and with ``access_log`` one access line per request at info, as uvicorn prints
    it (``client - "POST /v1/completions HTTP/1.1" 200``). ``log_format`` "text" keeps uvicorn's
    handlers; "json" installs none, so its lines reach the root logger that `setup` made."""
    import uvicorn

    check_format(log_format, "log_format")
    if log_format == "json":
        kwargs["log_config"] = None
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # a text config's own handlers, if one ran
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True
    config = uvicorn.Config(app, log_level="warning", access_log=access_log, **kwargs)
    if access_log:  # after Config: it sets every uvicorn logger to log_level
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config
