"""Traces and logs, unit by unit (common/tracing.py, common/jsonlog.py): the W3C context read
from headers, the tracer off by default and with nothing of the SDK imported, OTLP over HTTP to
a receiver run here, the task's traceparent on the queue's wire, and JSON log lines with the
request and trace ids."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from pdserve.common import jsonlog, tracing
from pdserve.kvtransfer.task import PrefillTask, task_from_wire, task_to_wire

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_the_w3c_context_is_read_from_headers_and_a_bad_one_is_no_context():
    tp = f"00-{TRACE}-{PARENT}-01"
    assert tracing.carrier_of([("TraceParent", tp), ("tracestate", "a=1"), ("x", "y")]) == {
        "traceparent": tp, "tracestate": "a=1"}
    assert tracing.carrier_of({"traceparent": tp}) == {"traceparent": tp}
    assert tracing.trace_id_of({"traceparent": tp}) == TRACE
    for bad in (f"00-{'0' * 32}-{PARENT}-01", f"00-{TRACE}-{'0' * 16}-01", f"ff-{TRACE}-{PARENT}-01",
                f"00-{TRACE}-{PARENT}-01-extra", "garbage", f"00-{TRACE.upper()}-{PARENT}-01"):
        assert tracing.carrier_of([("traceparent", bad), ("tracestate", "a=1")]) is None, bad
    assert tracing.carrier_of(None) is None and tracing.trace_id_of(None) is None


def test_settings_are_checked_naming_the_field():
    with pytest.raises(ValueError, match="otlp_traces_sample_ratio"):
        tracing.TracingConfig("http://x:4317", None, 1.5)
    with pytest.raises(ValueError, match="otlp_traces_protocol"):
        tracing.TracingConfig("http://x:4317", "udp")
    with pytest.raises(ValueError, match="unknown key 'endpoint'"):
        tracing.TracingConfig.of({"endpoint": "http://x:4317"})
    with pytest.raises(ValueError, match="log_format"):
        jsonlog.check_format("xml", "log_format")


def test_tracing_is_off_by_default_and_imports_nothing_of_the_sdk():
    assert tracing.tracer("nobody") is tracing.NO_TRACER
    span = tracing.tracer("nobody").start("x", {"traceparent": f"00-{TRACE}-{PARENT}-01"})
    assert span is tracing.NO_SPAN and not span and span.traceparent() is None and span.carrier() == {}
    code = ("import sys; import pdserve.decode.frontend, pdserve.gateway.frontend, pdserve.prefill.worker; "
            "from pdserve.common import tracing; tracing.configure('decode', None); "
            "bad = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _Collector(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        type(self).got.append((self.path, req))
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_spans_go_over_otlp_http_as_children_of_the_callers_context():
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tr = tracing.configure("unit", {"otlp_traces_endpoint": f"http://127.0.0.1:{server.server_port}",
                                        "otlp_traces_protocol": "http/protobuf", "otlp_traces_sample_ratio": 1.0})
        assert tr is tracing.tracer("unit") and tr.enabled
        root = tr.start("unit.request", f"00-{TRACE}-{PARENT}-01", kind="server", attrs={"pdserve.n": 3, "none": None})
        assert root.trace_id == TRACE and root.traceparent().startswith(f"00-{TRACE}-")
        child = root.record("unit.stage", 1_000, 2_000_000, {"pdserve.bytes": 7})
        root.event("first_token")
        root.end()
        assert tr.flush(10)
        spans = {s.name: s for path, req in _Collector.got for rs in req.resource_spans
                 for ss in rs.scope_spans for s in ss.spans}
        assert {path for path, _ in _Collector.got} == {"/v1/traces"}
        assert spans["unit.request"].parent_span_id == bytes.fromhex(PARENT)
        assert spans["unit.stage"].parent_span_id == spans["unit.request"].span_id
        assert spans["unit.stage"].start_time_unix_nano == 1_000 and spans["unit.stage"].end_time_unix_nano == 2_000_000
        assert child.trace_id == TRACE
        service = {a.value.string_value for _, req in _Collector.got for rs in req.resource_spans
                   for a in rs.resource.attributes if a.key == "service.name"}
        assert service == {"pdserve-unit"}
    finally:
        assert tracing.configure("unit", None) is tracing.NO_TRACER
        server.shutdown()
        thread.join(5)


def test_a_sampled_out_trace_records_nothing_but_still_propagates():
    tr = tracing.configure("unit0", {"otlp_traces_endpoint": "http://127.0.0.1:9", "otlp_traces_sample_ratio": 0.0})
    try:
        span = tr.start("x")
        assert not span and int(span.traceparent()[-2:], 16) & 1 == 0  # not sampled: its children follow it
        assert span.record("y", 0, 1) is tracing.NO_SPAN
        span.end()
    finally:
        tracing.configure("unit0", None)


def test_the_tasks_traceparent_rides_the_queue_wire_only_when_set():
    task = PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4])
    assert "traceparent" not in task_to_wire(task)  # a worker that does not trace sends what it sent before
    tp = f"00-{TRACE}-{PARENT}-01"
    traced = PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4], traceparent=tp)
    assert task_from_wire(task_to_wire(traced)).traceparent == tp
    with pytest.raises(ValueError, match="traceparent"):
        PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4], traceparent=b"x")  # type: ignore[arg-type]


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    uv = {n: (list(lg.handlers), lg.propagate, lg.level) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")
          for lg in [logging.getLogger(n)]}
    yield
    for n, (hs, prop, lvl) in uv.items():
        lg = logging.getLogger(n)
        lg.handlers[:], lg.propagate = hs, prop
        lg.setLevel(lvl)
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_request_and_trace_ids(root_logger):
    out = io.StringIO()
    jsonlog.setup("json", "INFO", stream=out)
    jsonlog.uvicorn_config(object(), "json", True)  # as a worker's HTTP surface does: access lines to the root
    log = logging.getLogger("pdserve.test")
    log.setLevel(logging.INFO)  # (whatever an earlier test set on its parents)

    def in_a_request():
        jsonlog.bind("req-1", TRACE)
        log.info("admitted %d tokens", 12)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")

    import contextvars

    contextvars.copy_context().run(in_a_request)
    log.warning("no request here")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", "/v1/completions",
                                             "1.1", 200)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["message"] == "admitted 12 tokens" and lines[0]["level"] == "INFO"
    assert lines[0]["request_id"] == "req-1" and lines[0]["trace_id"] == TRACE
    assert lines[0]["logger"] == "pdserve.test" and lines[0]["ts"].endswith("Z")
    assert "ValueError: boom" in lines[1]["exc_info"] and lines[1]["request_id"] == "req-1"
    assert "request_id" not in lines[2] and "trace_id" not in lines[2]  # the binding stayed in its context
    assert lines[3]["http"] == {"client": "127.0.0.1:5", "method": "POST", "path": "/v1/completions",
                                "version": "1.1", "status": 200}


def test_text_lines_stay_as_before(root_logger):
    out = io.StringIO()
    jsonlog.setup("text", "INFO", stream=out)
    logging.getLogger("pdserve.test").setLevel(logging.INFO)
    logging.getLogger("pdserve.test").info("hello")
    assert out.getvalue().rstrip().endswith("INFO pdserve.test: hello")


def test_uvicorn_access_lines_are_on_and_json_hands_them_to_the_root_logger():
    config = jsonlog.uvicorn_config(object(), "json", True)
    assert config.log_config is None and config.access_log
    assert logging.getLogger("uvicorn.access").level == logging.INFO
    assert jsonlog.uvicorn_config(object(), "text", False).access_log is False
