"""Traces across the cluster (docs/cluster.md, "Tracing"): a gateway in front of two decode
workers and a prefill worker (a Ray actor in its own process), all exporting OTLP over gRPC to a
receiver this test runs (the TraceService of the OpenTelemetry protocol definitions). A remote
request sent with a client traceparent makes one trace whose spans come from the gateway, the
decode worker, the queue and the prefill worker in parent/child order, and whose stages add up
to the request's TTFT; a stream moved to another worker shows both workers in its trace, a
raced request both attempts, and a prefix a prefill worker borrows from a decode worker the
holder's span of the loan."""

from __future__ import annotations

import os
import random
import secrets
import threading
import time
from concurrent import futures

import grpc
import pytest
import ray
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.api import Client
from pdserve.api.client import build_request
from pdserve.cluster.etcd_server import EmbeddedEtcd
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.gateway.server import GatewayConfig
from pdserve.prefill.worker import PrefillWorker
from tests.harness import PERMISSIVE_POLICY, GatewayThread, WorkerThread, start_local_ray, wait_until

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
CLUSTER = "trace"
TOL_MS = 5.0  # clocks of one host, rounding to the microsecond, and the spans' own bookkeeping


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every span it is sent, with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, f"http://127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def cluster(receiver, llama_dir, tmp_path_factory):
    _, endpoint = receiver
    tracing = {"otlp_traces_endpoint": endpoint, "otlp_traces_sample_ratio": 1.0}
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray("pdserve-trace")
    decodes, prefill, gw = [], None, None
    try:
        with EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data") as etcd:
            common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=3,
                          ucx_env=UCX, tracing=tracing)
            try:
                for i in range(2):
                    decodes.append(WorkerThread(DecodeWorkerConfig(
                        **common, worker_id=f"decode-{i}", remote_prefill=True, remote_timeout_s=60,
                        router_policy=str(policy),
                        load_report_s=0.5)).start())
                prefill = ray.remote(PrefillWorker).options(num_cpus=0).remote(dict(**common, worker_id="prefill-0"))
                ray.get(prefill.start.remote(), timeout=180)
                for d in decodes:
                    wait_until(lambda: d.worker.remote.available(), 20)
                gw = GatewayThread(GatewayConfig([etcd.endpoint], CLUSTER, model=llama_dir, seed=0,
                                                 tracing=tracing)).start()
                wait_until(lambda: len(gw.gateway.backends.workers) == 2, 20)
                yield decodes, gw
            finally:
                if gw is not None:
                    gw.stop()
                if prefill is not None:
                    ray.get(prefill.stop.remote(), timeout=30)
                for d in decodes:
                    d.stop()
    finally:
        ray.shutdown()


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def traced_call(gw, ids, on_chunk=None, target=None, **kw):
    """Stream a request through the gateway (or to ``target``, a worker's gRPC address) with a
    client traceparent: (trace id, client span id, client TTFT ms, chunks)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    md = (("traceparent", f"00-{trace_id}-{span_id}-01"), ("tracestate", "client=1"))
    chunks, ttft_ms = [], None
    with Client(target or gw.gateway.grpc_address) as c:
        t0 = time.monotonic()
        for msg in c._stub.Generate(build_request(ids, **kw), timeout=120, metadata=md):
            if msg.token_ids and ttft_ms is None:
                ttft_ms = (time.monotonic() - t0) * 1e3
            chunks.append(msg)
            if on_chunk is not None:
                on_chunk(len(chunks))
    return trace_id, span_id, ttft_ms, chunks


def spans_by_name(rec, trace_id, names, timeout_s=20):
    """The trace's spans, once every one of ``names`` arrived: name -> [(service, span)]."""
    def have():
        got = {}
        for svc, s in rec.trace(trace_id):
            got.setdefault(s.name, []).append((svc, s))
        return got if names <= got.keys() else None
    wait_until(lambda: have() is not None, timeout_s)
    return have()


def ms(span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6


def attr(span, key):
    """A span attribute's value (string, int, double or bool), None when it has none."""
    for a in span.attributes:
        if a.key == key:
            return getattr(a.value, a.value.WhichOneof("value"))
    return None


def test_a_remote_request_makes_one_trace_across_gateway_decode_queue_and_prefill(receiver, cluster):
    rec, _ = receiver
    _, gw = cluster
    trace_id, client_span, client_ttft, chunks = traced_call(
        gw, prompt(96, 1), max_tokens=4, temperature=0.0, ignore_eos=True, route="remote")
    b = chunks[-1].breakdown
    assert b.route == "remote" and b.prefill_worker == "prefill-0" and not b.fell_back_to_local
    names = {"gateway.request", "gateway.attempt", "decode.request", "decode.admission", "queue.wait",
             "prefill.task", "prefill.compute", "kv.write", "kv.transfer"}
    got = spans_by_name(rec, trace_id, names)
    one = {n: got[n][0] for n in names}
    assert all(len(got[n]) == 1 for n in names), {n: len(v) for n, v in got.items()}
    svc = {n: one[n][0] for n in names}
    assert svc["gateway.request"] == svc["gateway.attempt"] == "pdserve-gateway"
    assert svc["decode.request"] == svc["decode.admission"] == svc["kv.transfer"] == "pdserve-decode"
    assert svc["queue.wait"] == svc["prefill.task"] == svc["prefill.compute"] == svc["kv.write"] == "pdserve-prefill"
    s = {n: one[n][1] for n in names}
    parent = {
        "gateway.request": bytes.fromhex(client_span), "gateway.attempt": s["gateway.request"].span_id,
        "decode.request": s["gateway.attempt"].span_id, "decode.admission": s["decode.request"].span_id,
        "queue.wait": s["decode.request"].span_id, "prefill.task": s["decode.request"].span_id,
        "kv.transfer": s["decode.request"].span_id, "prefill.compute": s["prefill.task"].span_id,
        "kv.write": s["prefill.task"].span_id}
    for name, want in parent.items():
        assert s[name].parent_span_id == want, name
    assert s["gateway.request"].trace_state == "client=1"
    # Children lie within their parents, and the stages follow each other.
    tol = int(TOL_MS * 1e6)
    for name, want in parent.items():
        if name != "gateway.request":
            up = next(x for x in s.values() if x.span_id == want)
            assert up.start_time_unix_nano - tol <= s[name].start_time_unix_nano, name
    path = ["decode.admission", "queue.wait", "prefill.compute", "kv.transfer"]
    for a, c in zip(path, path[1:]):
        assert s[a].end_time_unix_nano <= s[c].start_time_unix_nano + tol, (a, c)
    # The stages add up to the TTFT: what they leave is at most what the breakdown leaves.
    first = next(e for e in s["decode.request"].events if e.name == "first_token")
    ttft = (first.time_unix_nano - s["decode.request"].start_time_unix_nano) / 1e6
    assert abs(ttft - b.ttft_ms) <= TOL_MS
    stages = sum(ms(s[n]) for n in path)
    breakdown_gap = b.ttft_ms - (b.queue_wait_ms + b.prefill_ms + b.transfer_ms)
    assert -TOL_MS <= ttft - stages <= max(breakdown_gap, 0.0) + TOL_MS, (ttft, stages, breakdown_gap)
    assert ttft <= client_ttft + TOL_MS
    attrs = {a.key: a.value for a in s["decode.request"].attributes}
    assert attrs["pdserve.route"].string_value == "remote"
    assert attrs["pdserve.prompt_tokens"].int_value == 96
    assert abs(attrs["pdserve.transfer_ms"].double_value - b.transfer_ms) < 1e-6
    kv = {a.key: a.value for a in s["kv.write"].attributes}
    assert kv["pdserve.transfer_bytes"].int_value > 0


def test_a_raced_request_shows_both_attempts_under_its_request_span(receiver, cluster):
    """Racing on (gateway/frontend.py `_race`): the request runs on both decode workers; its trace
    has both attempts as children of gateway.request, each saying whether it won or lost (the
    loser ended early), the request naming the winner and the loser, and the winner's
    decode.request under the winner's attempt."""
    rec, _ = receiver
    _, gw = cluster
    fe = gw.gateway.frontend
    ids = prompt(40, 3)
    wait_until(lambda: len(gw.gateway.backends.pick(ids, set()).scores) == 2, 20)  # both pickable
    fe.race_fraction, fe.race_risk = 1.0, 1e-6  # every request with a target races
    try:
        trace_id, client_span, _, chunks = traced_call(gw, ids, max_tokens=6, temperature=0.0, ignore_eos=True,
                                                       route="local", ttft_slo_ms=1000.0)
    finally:
        fe.race_fraction, fe.race_risk = 0.0, 0.5
    assert sum(len(c.token_ids) for c in chunks) == 6
    wait_until(lambda: len(spans_by_name(rec, trace_id, {"gateway.attempt"})["gateway.attempt"]) == 2, 20)
    got = spans_by_name(rec, trace_id, {"gateway.request", "gateway.attempt", "decode.request"})
    (_, root), = got["gateway.request"]
    assert root.parent_span_id == bytes.fromhex(client_span)
    winner, loser = attr(root, "pdserve.race_winner"), attr(root, "pdserve.race_loser")
    assert {winner, loser} == {"decode-0", "decode-1"}
    attempts = {attr(s, "pdserve.worker_id"): s for _, s in got["gateway.attempt"]}
    assert attempts.keys() == {winner, loser}
    assert all(s.parent_span_id == root.span_id for s in attempts.values())
    assert attr(attempts[winner], "pdserve.race") == "won" and attr(attempts[winner], "pdserve.outcome") is None
    assert attr(attempts[loser], "pdserve.race") == "lost" and attr(attempts[loser], "pdserve.outcome") == "ended early"
    def decoded():
        return {attr(s, "pdserve.worker_id"): s for _, s in spans_by_name(rec, trace_id, {"decode.request"})[
            "decode.request"]}

    wait_until(lambda: winner in decoded(), 20)  # (each worker's span ends with its stream)
    decoded = decoded()
    assert decoded[winner].parent_span_id == attempts[winner].span_id
    if loser in decoded:  # (when its call reached the loser before it was cancelled)
        assert decoded[loser].parent_span_id == attempts[loser].span_id


def test_a_prefix_lent_to_a_prefill_worker_shows_the_holders_span_in_the_requests_trace(receiver, cluster):
    """A conversation whose first turn decode-0 prefilled itself goes remote for its second: the
    prefill worker borrows the first turn's blocks from decode-0 (prefill/loans.py) and the
    loan request carries its kv.borrow span's traceparent (kvtransfer/lend.py), so decode-0's
    kv.lend is in the request's trace: decode.request > kv.borrow (prefill) > kv.lend (decode)."""
    rec, _ = receiver
    decodes, gw = cluster
    d = decodes[0]
    wait_until(lambda: "prefill-0" in d.worker.remote.peers.agent.peers, 30)
    first = prompt(320, 4)
    _, _, _, turn1 = traced_call(gw, first, target=d.grpc, max_tokens=4, temperature=0.0, ignore_eos=True,
                                 route="local")
    second = first + [t for c in turn1 for t in c.token_ids] + prompt(40, 5)
    trace_id, _, _, chunks = traced_call(gw, second, target=d.grpc, max_tokens=4, temperature=0.0,
                                         ignore_eos=True, route="remote")
    assert chunks[-1].breakdown.route == "remote" and not chunks[-1].breakdown.fell_back_to_local
    got = spans_by_name(rec, trace_id, {"decode.request", "prefill.task", "kv.borrow", "kv.lend"})
    (svc_req, req), = got["decode.request"]
    (svc_borrow, borrow), = got["kv.borrow"]
    (svc_lend, lend), = got["kv.lend"]
    assert (svc_req, svc_borrow, svc_lend) == ("pdserve-decode", "pdserve-prefill", "pdserve-decode")
    assert borrow.parent_span_id == req.span_id and lend.parent_span_id == borrow.span_id
    assert attr(borrow, "pdserve.outcome") == "read" and attr(borrow, "pdserve.holder") == "decode-0"
    assert attr(lend, "pdserve.outcome") == "confirmed" and attr(lend, "pdserve.borrower") == "prefill-0"
    assert attr(lend, "pdserve.lent_blocks") == attr(borrow, "pdserve.blocks") >= 20  # 320 tokens, blocks of 16
    assert attr(borrow, "pdserve.read_tokens") > 0
    assert borrow.start_time_unix_nano <= lend.start_time_unix_nano + int(TOL_MS * 1e6)
    assert [e.name for e in lend.events] == ["granted"]


def test_a_migrated_stream_shows_both_workers_in_its_trace(receiver, cluster):
    rec, _ = receiver
    decodes, gw = cluster
    handed = []

    def hand_back(n):  # after a few tokens: the worker holding the stream hands it back (a drain)
        if n == 3 and not handed:
            for d in decodes:
                if d.worker.frontend.inflight:
                    handed.append(d.worker.worker_id)
                    d.loop.call_soon_threadsafe(d.worker.frontend.hand_back)

    trace_id, _, _, chunks = traced_call(gw, prompt(24, 2), max_tokens=40, temperature=0.0, ignore_eos=True,
                                         route="local", on_chunk=hand_back)
    assert handed and chunks[-1].breakdown.migrations == 1
    assert sum(len(c.token_ids) for c in chunks) == 40
    wait_until(lambda: len(spans_by_name(rec, trace_id, {"decode.request"})["decode.request"]) == 2, 20)
    got = spans_by_name(rec, trace_id, {"gateway.request", "gateway.attempt", "decode.request"})
    attempts = [s for _, s in got["gateway.attempt"]]
    workers = {next(a.value.string_value for a in s.attributes if a.key == "pdserve.worker_id") for s in attempts}
    assert len(attempts) == 2 and workers == {"decode-0", "decode-1"}
    decoded = {next(a.value.string_value for a in s.attributes if a.key == "pdserve.worker_id"): s
               for _, s in got["decode.request"]}
    assert decoded.keys() == {"decode-0", "decode-1"}
    for s in decoded.values():  # each worker's request span is the child of its own attempt
        assert s.parent_span_id in {a.span_id for a in attempts}
    (_, root), = got["gateway.request"]
    assert [e.name for e in root.events].count("migration") == 1
