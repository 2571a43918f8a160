"""Speculative decoding on a live decode worker (decode/spec_metrics.py, decode/breakdown.py;
docs/speculative.md): its ``/metrics`` export the engine's counters under
``pdserve_spec_decode_*``, each request's breakdown (gRPC and HTTP) carries the tokens proposed
for it and accepted, summing to the engine's counters, and the greedy output equals a worker's
without speculation. A worker that does not speculate exports none of it."""

from __future__ import annotations

import random
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api import Client
from pdserve.decode.spec_metrics import PER_POSITION, SPEC_METRICS
from pdserve.decode.worker import DecodeWorkerConfig
from pdserve.router.decide import decide
from pdserve.router.values import RequestFeatures
from tests.harness import PERMISSIVE_POLICY, WorkerThread

DOC = Path(__file__).resolve().parents[2] / "docs" / "speculative.md"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
FIELDS = {name: field for name, _, field in SPEC_METRICS}


def repetitive(n: int, seed: int) -> list[list[int]]:
    """A phrase said again and again: n-gram proposals get accepted."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(3, 8))] * rng.randrange(3, 6) for _ in range(n)]


def start(llama_dir, tmp_path_factory, spec: dict | None) -> WorkerThread:
    policy = tmp_path_factory.mktemp("policy") / "router.yaml"
    policy.write_text(PERMISSIVE_POLICY)
    args: dict = {"max_model_len": 512}
    if spec is not None:
        args["speculative_config"] = spec
    return WorkerThread(DecodeWorkerConfig(model=llama_dir, engine_args=args, router_policy=str(policy))).start()


@pytest.fixture(scope="module")
def workers(llama_dir, tmp_path_factory):
    spec = start(llama_dir, tmp_path_factory, NGRAM)
    try:
        plain = start(llama_dir, tmp_path_factory, None)
    except BaseException:
        spec.stop()
        raise
    yield spec, plain
    plain.stop()
    spec.stop()


def spec_samples(worker: WorkerThread) -> tuple[dict[str, float], dict[int, float]]:
    """The pdserve_spec_decode_* counters (by EngineStats field) and the per-position one."""
    r = httpx.get(f"{worker.http}/metrics", timeout=30)
    assert r.status_code == 200
    labels = {"role": "decode", "worker_id": worker.worker.worker_id}
    totals, per = {}, {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            if family.name in FIELDS:
                assert s.labels == labels, s
                totals[FIELDS[family.name]] = s.value
            elif family.name == PER_POSITION:
                per[int(s.labels.pop("position"))] = s.value
                assert s.labels == labels, s
    return totals, per


def test_metrics_and_breakdowns_count_what_the_engine_verified(workers):
    spec, plain = workers
    stats = spec.worker.engine.stats
    before, _ = spec_samples(spec)
    assert before == {f: float(getattr(stats, f)) for f in FIELDS.values()}
    prompts = repetitive(6, seed=3)
    kw = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
    with Client(spec.grpc) as c, Client(plain.grpc) as p:
        outs = [c.generate(pr, **kw) for pr in prompts]
        want = [p.generate(pr, **kw) for pr in prompts]
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]  # greedy: as without speculation
    after, per = spec_samples(spec)
    drafted = sum(o.breakdown["spec_draft_tokens"] for o in outs)
    accepted = sum(o.breakdown["spec_accepted_tokens"] for o in outs)
    assert after["num_spec_draft_tokens"] - before["num_spec_draft_tokens"] == drafted
    assert after["num_spec_accepted_tokens"] - before["num_spec_accepted_tokens"] == accepted > 20
    assert after["num_spec_drafts"] > before["num_spec_drafts"]
    assert all(0 <= o.breakdown["spec_accepted_tokens"] <= o.breakdown["spec_draft_tokens"] for o in outs)
    assert per == {j: float(n) for j, n in enumerate(stats.spec_accepted_per_position)}
    assert sum(per.values()) == after["num_spec_accepted_tokens"] and per[0] >= per[len(per) - 1]
    assert all("spec_draft_tokens" not in w.breakdown for w in want)  # a worker without speculation


def test_the_http_breakdown_carries_the_counts(workers):
    spec, plain = workers
    body = {"prompt": repetitive(1, seed=5)[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = [httpx.post(f"{w.http}/v1/completions", timeout=120, json=body).json() for w in (spec, plain)]
    b, b_plain = (g["choices"][0]["pdserve"] for g in got)
    assert b["spec_accepted_tokens"] > 0 and b["spec_draft_tokens"] >= b["spec_accepted_tokens"]
    assert got[0]["choices"][0]["text"] == got[1]["choices"][0]["text"]
    assert "spec_draft_tokens" not in b_plain and "spec_accepted_tokens" not in b_plain


def test_the_router_sees_the_workers_speculation(workers):
    """The snapshot the router decides on (decode/frontend.py) carries the k a new stream gets
    and the tokens a verifying step gave so far (engine counters, after the tests above), and
    an explained decision says so; a worker without speculation carries none."""
    spec, plain = workers
    stats = spec.worker.engine.stats
    assert stats.num_spec_accepted_tokens > 0  # the tests above ran speculating requests
    snap = spec.worker.frontend.snapshot()
    assert snap.spec_k == 4
    assert snap.spec_tokens_per_step == pytest.approx(1 + stats.num_spec_accepted_tokens / stats.num_spec_drafts)
    assert snap.spec_tokens_per_step > 1.0
    feats = RequestFeatures(prompt_len=100)
    trace = decide(feats, snap, spec.worker.frontend.policy.policy, explain=True).trace
    assert any(line.startswith("speculative decoding: k = 4 proposals per step") for line in trace)
    snap_plain = plain.worker.frontend.snapshot()
    assert (snap_plain.spec_k, snap_plain.spec_tokens_per_step) == (None, 1.0)
    assert not any("speculative" in line for line in decide(
        feats, snap_plain, plain.worker.frontend.policy.policy, explain=True).trace)


def test_a_worker_without_speculation_exports_no_spec_metrics(workers):
    _, plain = workers
    text = httpx.get(f"{plain.http}/metrics", timeout=30).text
    assert "pdserve_spec_decode" not in text


def test_every_metric_is_documented():
    doc = DOC.read_text()
    for name in [*FIELDS, PER_POSITION]:
        assert re.search(rf"`{name}(_total)?[`{{]", doc), name
