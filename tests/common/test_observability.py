"""Traces and logs, unit by unit (common/tracing.py, common/jsonlog.py): the W3C context read
from headers, the tracer off by default and with nothing of the SDK imported, OTLP over HTTP to
a receiver run here, the task's and the loan request's traceparent on their wires, a holder's
span of a traced loan, and JSON log lines with the request and trace ids, from the engine
thread too."""

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


def test_the_loan_requests_traceparent_rides_the_lend_wire_only_when_set():
    from pdserve.kvtransfer.lend import LendRequest, MalformedLendError, decode_lend

    plain = LendRequest("l1", b"h" * 16, 2)
    assert b"traceparent" not in plain.encode()  # an untraced borrow sends what it sent before
    assert decode_lend(plain.encode()).traceparent == ""
    tp = f"00-{TRACE}-{PARENT}-01"
    assert decode_lend(LendRequest("l1", b"h" * 16, 2, traceparent=tp).encode()).traceparent == tp
    with pytest.raises(MalformedLendError, match="traceparent"):
        LendRequest("l1", b"h" * 16, 2, traceparent=b"x")  # type: ignore[arg-type]


class _LoanAgent:
    """A transport that knows the borrower and keeps what it is sent."""

    peers = ("borrower",)

    def __init__(self):
        self.sent = []

    def send_notification(self, peer, payload):
        self.sent.append((peer, payload))


class _Holds:
    """An engine that holds every chain it is asked for (blocks 10, 11, ...), pinned until unlent."""

    def __init__(self):
        self.lent = []

    def lend_chain(self, tail_hash, num_blocks):
        ids = list(range(10, 10 + num_blocks))
        self.lent += ids
        return ids

    def load_chain(self, tail_hash, num_blocks, key):
        return None

    def finish_tier_loads(self):
        pass

    def unlend(self, block_ids):
        for b in block_ids:
            self.lent.remove(b)


def test_a_traced_loan_is_the_holders_kv_lend_span_under_the_borrowers_context():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.kvtransfer.lend import LendRelease, LendRequest, decode_lend
    from pdserve.kvtransfer.lender import Lender

    exporter = InMemorySpanExporter()
    tr = tracing.configure("unitlend", {"otlp_traces_endpoint": "http://127.0.0.1:9", "otlp_traces_sample_ratio": 1.0},
                           exporter=exporter)
    try:
        pool, agent = _Holds(), _LoanAgent()
        lender = Lender(pool, agent)
        lender.trace_as = "unitlend"
        tp = f"00-{TRACE}-{PARENT}-01"
        lender.handle("borrower", LendRequest("traced", b"h" * 16, 3, traceparent=tp))
        lender.handle("borrower", LendRequest("untraced", b"g" * 16, 2))
        grant = decode_lend(agent.sent[0][1])
        assert grant.block_ids == (10, 11, 12) and pool.lent
        lender.handle("borrower", LendRelease("traced", grant.epoch))  # the read completed: confirmed
        lender.handle("borrower", LendRelease("untraced", grant.epoch))
        assert not pool.lent and not lender._spans
        assert tr.flush(10)
        (span,) = exporter.get_finished_spans()  # the untraced loan made none
        assert span.name == "kv.lend" and span.kind.name == "SERVER"
        assert f"{span.context.trace_id:032x}" == TRACE and f"{span.parent.span_id:016x}" == PARENT
        assert span.attributes["pdserve.outcome"] == "confirmed" and span.attributes["pdserve.lent_blocks"] == 3
        assert span.attributes["pdserve.borrower"] == "borrower"
        assert [e.name for e in span.events] == ["granted"]
    finally:
        tracing.configure("unitlend", None)


def test_a_prefill_workers_lines_about_a_task_name_its_request_and_trace():
    from pdserve.prefill.tracing import task_log_ids, track_task

    tp = f"00-{TRACE}-{PARENT}-01"
    assert task_log_ids(PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4], traceparent=tp)) == {
        "request_id": "r", "trace_id": TRACE}
    assert task_log_ids(PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4])) == {"request_id": "r"}
    track_task("r-engine", PrefillTask("r", 1, [1, 2, 3], 0, "decode-0", [4], traceparent=tp))
    assert jsonlog.about("r-engine") == {"request_id": "r", "trace_id": TRACE}  # the engine's lines about it
    jsonlog.untrack("r-engine")


def test_ids_filed_for_a_request_name_it_in_lines_from_another_thread(root_logger):
    out = io.StringIO()
    jsonlog.setup("json", "INFO", stream=out)
    log = logging.getLogger("pdserve.test.thread")
    log.setLevel(logging.INFO)

    def in_a_request():
        jsonlog.bind("client-7", TRACE)
        jsonlog.track("engine-7")  # the ids bound here, under the engine's id

    import contextvars

    contextvars.copy_context().run(in_a_request)
    t = threading.Thread(target=lambda: log.info("about it", extra=jsonlog.about("engine-7")), name="other")
    t.start()
    t.join(10)
    jsonlog.untrack("engine-7")
    assert jsonlog.about("engine-7") == {"request_id": "client-7", "trace_id": TRACE}  # (a late line still knows)
    assert jsonlog.about("never-filed") == {"request_id": "never-filed"}
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line["thread"] == "other" and line["request_id"] == "client-7" and line["trace_id"] == TRACE


def test_engine_thread_lines_about_a_request_carry_its_request_and_trace_ids(root_logger, llama_dir):
    """A decode worker's engine thread (decode/async_engine.py) logs a request's abort and a
    request's end: with --log-format json each line names the request and trace the request path
    bound, though context variables never reach that thread."""
    import asyncio
    import contextvars

    from pdserve.decode.async_engine import AsyncEngine
    from pdserve.engine import LLM, SamplingParams

    out = io.StringIO()
    jsonlog.setup("json", "DEBUG", stream=out)
    engine_log = logging.getLogger("pdserve.decode.async_engine")
    level = engine_log.level
    engine_log.setLevel(logging.DEBUG)
    llm = LLM(llama_dir, max_model_len=256)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            async def request(label, engine_id, params, abort):  # as a request's task binds and files its ids
                jsonlog.bind(label, TRACE if abort else "a" * 32)
                jsonlog.track(engine_id)
                q = ae.submit(engine_id, [5, 6, 7, 8], params, 0)
                while True:
                    item, _ = await asyncio.wait_for(q.get(), 60)
                    if abort:
                        ae.abort(engine_id)
                        abort = False
                    if isinstance(item, BaseException) or item.finished:
                        jsonlog.untrack(engine_id)
                        return item.finish_reason

            return await asyncio.gather(
                asyncio.create_task(request("client-a", "eng-a", long, True), context=contextvars.Context()),
                asyncio.create_task(request("client-b", "eng-b", short, False), context=contextvars.Context()))
        finally:
            ae.stop()

    try:
        assert asyncio.run(main()) == ["abort", "length"]
    finally:
        llm.close()
        engine_log.setLevel(level)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    engine = {x["message"]: x for x in lines if x["thread"] == "pdserve-engine"}
    aborted, finished = engine["request eng-a aborted"], engine["request eng-b finished (length)"]
    assert aborted["request_id"] == "client-a" and aborted["trace_id"] == TRACE
    assert finished["request_id"] == "client-b" and finished["trace_id"] == "a" * 32
