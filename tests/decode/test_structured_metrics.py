"""The structured-output compiler's metrics (cluster/grammar_metrics.py) on a live decode worker's
``/metrics`` and in its stats, and on a prefill worker's metrics object over a real engine:
a grammar compiled (a miss), found again (a hit), one that does not compile (an error), each
read back as exported. Every metric is documented in docs/structured.md."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.grammar_metrics import GRAMMAR_METRICS
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.values import PrefillStats

DOC = Path(__file__).resolve().parents[2] / "docs" / "structured.md"
KEYS = {name: key for name, _, _, key in GRAMMAR_METRICS}


def grammar_samples(text: str, labels: dict[str, str]) -> dict[str, float]:
    """The pdserve_grammar_* samples with exactly ``labels``, by stats key."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name not in KEYS:
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            assert s.labels == labels, s
            out[KEYS[family.name]] = s.value
    return out


def scrape(worker) -> dict[str, float]:
    r = httpx.get(f"{worker.http}/metrics", timeout=30)
    assert r.status_code == 200
    return grammar_samples(r.text, {"role": "decode", "worker_id": worker.worker.worker_id})


def complete(worker, regex: str) -> httpx.Response:
    return httpx.post(f"{worker.http}/v1/completions", timeout=120, json={
        "prompt": "Code:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": regex}})


def test_a_miss_a_hit_and_an_error_are_exported_as_the_engine_counts_them(worker):
    eng = worker.worker.engine
    before = scrape(worker)
    assert set(before) == set(KEYS.values())
    assert before == pytest.approx(eng.grammar_stats())  # every key, as the engine counts it

    regex = r"[a-f]{3}-[0-9]{2}"  # new to this worker
    assert complete(worker, regex).status_code == 200
    miss = scrape(worker)
    assert miss["misses"] == before["misses"] + 1 and miss["compile_errors"] == before["compile_errors"]
    assert miss["entries"] == before["entries"] + 1 and miss["bytes"] > before["bytes"]
    assert miss["compile_seconds"] > before["compile_seconds"]

    assert complete(worker, regex).status_code == 200
    hit = scrape(worker)
    assert hit["misses"] == miss["misses"] and hit["hits"] > miss["hits"]
    assert hit["entries"] == miss["entries"]

    bad = complete(worker, "(unclosed")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs.regex"
    err = scrape(worker)
    assert err["compile_errors"] == hit["compile_errors"] + 1 and err["misses"] == hit["misses"] + 1
    assert err["entries"] == hit["entries"]  # nothing cached for it
    assert err == pytest.approx(eng.grammar_stats())

    stats = worker.worker.stats()["grammars"]  # what the worker's stats report
    assert stats == pytest.approx(eng.grammar_stats())


def test_the_prefill_metrics_export_the_engines_compiler(worker):
    """PrefillMetrics over a real engine (the prefill worker registers its engine's in start)."""
    eng = worker.worker.engine
    m = PrefillMetrics("p0", PrefillStats())
    assert grammar_samples(m.render().decode(), {"worker_id": "p0"}) == {}  # not watched yet: none
    m.watch_grammars(eng.grammar_stats)
    assert complete(worker, r"(ab|cd){2}!").status_code == 200
    assert complete(worker, "[z-a]").status_code == 400
    got = grammar_samples(m.render().decode(), {"worker_id": "p0"})
    assert got == pytest.approx(eng.grammar_stats())
    assert got["misses"] >= 2 and got["compile_errors"] >= 1 and got["entries"] >= 1


def test_every_grammar_metric_is_documented():
    doc = DOC.read_text(encoding="utf-8")
    documented = set(re.findall(r"`(pdserve_grammar_\w+)`", doc))
    exported = {name + ("_total" if kind == "counter" else "") for name, kind, _, _ in GRAMMAR_METRICS}
    assert documented == exported
