"""`pdserve top`: the Prometheus text parser and the windowed figures (rates, percentiles from
bucket deltas, counts by label) on fixed metric text and on what the workers' own metric
classes render; `--once` against a real etcd (a worker whose /metrics does not answer is shown
as unreachable with the reason; etcd down is one line, not a traceback); and the live view in a
real terminal: tmux running `pdserve top` against a 1P1D cluster (real etcd, Ray's prefill
queue, NIXL), both workers shown, the frame updated after a request, `q` ends it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.cli import main
from pdserve.cluster.etcd_server import EmbeddedEtcd, free_loopback_port
from pdserve.top_metrics import Ring, Scrape, Span, bucket_delta, counter_delta
from pdserve.top_view import Header, Worker, frame

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]

LABELS = 'role="decode",worker_id="d0"'


def decode_text(b01: float, b02: float, inf: float, length: float, stop: float, local: float,
                remote: float, gen: float) -> str:
    return f"""\
# HELP pdserve_time_to_first_token_seconds Time to first token
# TYPE pdserve_time_to_first_token_seconds histogram
pdserve_time_to_first_token_seconds_bucket{{{LABELS},le="0.1"}} {b01}
pdserve_time_to_first_token_seconds_bucket{{{LABELS},le="0.2"}} {b02}
pdserve_time_to_first_token_seconds_bucket{{{LABELS},le="+Inf"}} {inf}
pdserve_time_to_first_token_seconds_count{{{LABELS}}} {inf}
pdserve_time_to_first_token_seconds_sum{{{LABELS}}} 0.5
pdserve_time_to_first_token_seconds_created{{{LABELS}}} 1.7e9
# HELP pdserve_requests_total Finished requests by finish reason
# TYPE pdserve_requests_total counter
pdserve_requests_total{{{LABELS},finish_reason="length"}} {length}
pdserve_requests_total{{{LABELS},finish_reason="stop"}} {stop}
pdserve_requests_created{{{LABELS},finish_reason="stop"}} 1.7e9
# HELP pdserve_router_decisions_total Router decisions by route and reason
# TYPE pdserve_router_decisions_total counter
pdserve_router_decisions_total{{{LABELS},route="local",reason="short_prompt"}} {local}
pdserve_router_decisions_total{{{LABELS},route="remote",reason="cost_model"}} {remote}
# HELP pdserve_generation_tokens_total Generated tokens
# TYPE pdserve_generation_tokens_total counter
pdserve_generation_tokens_total{{{LABELS}}} {gen}
# HELP pdserve_num_requests_running Requests in the running batch
# TYPE pdserve_num_requests_running gauge
pdserve_num_requests_running{{{LABELS}}} 3.0
"""


OLD = decode_text(2, 4, 4, length=3, stop=1, local=2, remote=0, gen=100)
NEW = decode_text(2, 8, 10, length=7, stop=3, local=4, remote=3, gen=160)


def test_parse_keeps_every_sample_and_drops_creation_times():
    s = Scrape.parse(OLD)
    assert s.value("pdserve_requests_total") == 4.0  # both finish reasons
    assert s.value("pdserve_requests_total", finish_reason="stop") == 1.0
    assert s.value("pdserve_requests_created") is None and s.value("pdserve_no_such_total") is None
    assert s.buckets("pdserve_time_to_first_token_seconds") == [(0.1, 2.0), (0.2, 4.0), (float("inf"), 4.0)]
    assert s.by_label("pdserve_router_decisions_total", "route") == {("local",): 2.0, ("remote",): 0.0}
    assert s.value("pdserve_num_requests_running") == 3.0
    with pytest.raises(ValueError):
        Scrape.parse("pdserve_x{le=\"0.1\" 1\n")  # not Prometheus text


def test_rates_percentiles_and_counts_come_from_the_deltas_between_two_scrapes():
    span = Span(2.0, Scrape.parse(OLD), Scrape.parse(NEW))
    assert span.rate("pdserve_requests_total") == pytest.approx(3.0)  # (10 - 4) / 2 s
    assert span.rate("pdserve_generation_tokens_total") == pytest.approx(30.0)
    assert span.rate("pdserve_absent_total") is None
    # Observed in between: 0 at or below 0.1 s, 4 in (0.1, 0.2], 2 above: 6 samples.
    assert span.observations("pdserve_time_to_first_token_seconds") == [(0.1, 0.0), (0.2, 4.0), (float("inf"), 6.0)]
    assert span.count("pdserve_time_to_first_token_seconds") == 6.0
    p = span.percentiles("pdserve_time_to_first_token_seconds", (0.5, 0.9))
    assert p[0.5] == pytest.approx(0.1 + 0.1 * 3 / 4)  # rank 3 of the 4 in (0.1, 0.2]
    assert p[0.9] == pytest.approx(0.2)  # in +Inf: the highest finite bound
    assert span.increase("pdserve_router_decisions_total", "route", "reason") == {
        ("local", "short_prompt"): 2.0, ("remote", "cost_model"): 3.0}
    assert Span(1.0, Scrape.parse(OLD), Scrape.parse(OLD)).percentiles("pdserve_time_to_first_token_seconds") == {}


def test_a_worker_that_restarted_counts_from_zero():
    assert counter_delta(10.0, 2.0) == 2.0 and counter_delta(2.0, 10.0) == 8.0 and counter_delta(None, 5.0) == 5.0
    assert bucket_delta([(0.1, 5.0), (float("inf"), 9.0)], [(0.1, 1.0), (float("inf"), 2.0)]) == [
        (0.1, 1.0), (float("inf"), 2.0)]
    span = Span(1.0, Scrape.parse(NEW), Scrape.parse(OLD))  # counters went down
    assert span.rate("pdserve_requests_total") == pytest.approx(4.0)


def test_the_ring_keeps_a_minute_and_spans_the_window_asked():
    ring = Ring(keep_s=60.0)
    assert ring.span(60) is None
    scrapes = {t: Scrape.parse(decode_text(0, 0, t, 0, 0, 0, 0, gen=t)) for t in (0, 30, 61, 70, 95)}
    for t, s in scrapes.items():
        ring.add(float(t), s)
    assert len(ring) == 4  # t=0 fell out: t=30 is the baseline of a full minute at t=95
    span = ring.span(60.0)
    assert span is not None and span.seconds == 34.0 and span.old is scrapes[61]
    short = ring.span(10.0)  # nothing but the newest within 10 s: the one before it
    assert short is not None and short.seconds == 25.0 and short.old is scrapes[70]


def _worker(wid: str, role: str, texts: list[str], load: dict | None = None, error: str | None = None) -> Worker:
    ring = Ring()
    for i, text in enumerate(texts):
        ring.add(float(i * 2), Scrape.parse(text))
    return Worker(wid, {"role": role, "load": load or {}, "endpoints": {}}, ring, error=error,
                  url=f"http://127.0.0.1:1/metrics#{wid}")


def test_a_frame_shows_each_worker_its_rates_routes_and_the_unreachable_with_the_reason():
    workers = [_worker("d0", "decode", [OLD, NEW], {"kv_usage": 0.25, "busy": 0.5}),
               _worker("p0", "prefill", [], {"kv_usage": 0.1, "inflight": 1}, error="ConnectError: refused")]
    lines = frame(Header("c1", ["127.0.0.1:2379"], 1.0), workers, now=0)
    text = "\n".join(lines)
    d0 = next(ln for ln in lines if ln.startswith("d0 "))
    assert d0.split() == ["d0", "decode", "up", "3", "-", "-", "25%", "50%", "3.00", "0.0", "30.0", "10"]
    p0 = next(ln for ln in lines if ln.startswith("p0 "))
    assert p0.split()[:4] == ["p0", "prefill", "unreachable", "1"]
    assert "p0: /metrics http://127.0.0.1:1/metrics#p0: ConnectError: refused" in text
    assert "routes, last 60 s: local 2 (short_prompt 2), remote 3 (cost_model 3)" in text
    assert "fallbacks, last 60 s: none" in text
    ttft = next(ln for ln in lines if ln.startswith("  d0 "))
    assert ttft.split()[1:5] == ["6", "175ms", "200ms", "200ms"]


def test_the_figures_of_the_workers_own_metrics_are_found():
    """What decode/metrics.py and prefill/metrics.py render is what the view reads (a metric
    renamed there fails here)."""
    from pdserve.decode.metrics import WorkerMetrics
    from pdserve.prefill.metrics import PrefillMetrics
    from pdserve.prefill.values import PrefillStats

    dm = WorkerMetrics("decode", "decode-0")
    stats = PrefillStats()
    pm = PrefillMetrics("prefill-0", stats)
    texts: dict[str, list[str]] = {"d": [dm.render().decode()], "p": [pm.render().decode()]}
    for _ in range(4):
        dm.ttft.observe(0.03)
        dm.tpot.observe(0.004)
        dm.queue_wait.observe(0.002)
        dm.request_finished("length")
        dm.decision("remote", "cost_model")
    dm.fallback("queue_timeout")
    dm.generation_tokens.inc(40)
    dm.prompt_tokens.inc(400)
    dm.running.set(2)
    dm.kv_usage.set(0.5)
    stats.tasks_done, stats.tokens_computed = 3, 300
    texts["d"].append(dm.render().decode())
    texts["p"].append(pm.render().decode())
    workers = [_worker("decode-0", "decode", texts["d"]), _worker("prefill-0", "prefill", texts["p"], {"inflight": 0})]
    lines = frame(Header("c1", ["e:1"], 1.0), workers, now=0)
    text = "\n".join(lines)
    assert next(ln for ln in lines if ln.startswith("decode-0 ")).split() == [
        "decode-0", "decode", "up", "2", "0", "0", "50%", "-", "2.00", "200.0", "20.0", "4"]
    assert next(ln for ln in lines if ln.startswith("prefill-0 ")).split() == [
        "prefill-0", "prefill", "up", "0", "-", "-", "-", "-", "1.50", "150.0", "-", "3"]
    assert "routes, last 60 s: remote 4 (cost_model 4)" in text
    assert "fallbacks, last 60 s: remote->local 1 (queue_timeout 1)" in text
    ttft = next(ln for ln in lines if ln.startswith("  decode-0 ")).split()
    assert ttft[1] == "4" and ttft[2].endswith("ms") and 25 < float(ttft[2][:-2]) <= 50  # in (25, 50] ms


def test_bad_flags_name_the_flag(capsys):
    assert main(["top", "--etcd", "127.0.0.1:1", "--cluster", "c", "--interval", "0", "--once"]) == 2
    assert "--interval 0" in capsys.readouterr().err
    assert main(["top", "--etcd", "127.0.0.1:1", "--once"]) == 2
    assert "--etcd and --cluster go together" in capsys.readouterr().err


def test_etcd_down_is_one_line_and_exit_1(capsys):
    assert main(["top", "--etcd", f"127.0.0.1:{free_loopback_port()}", "--cluster", "c", "--once"]) == 1
    out = capsys.readouterr().out
    assert "etcd did not answer" in out and "Traceback" not in out


# --- against a real etcd and a real 1P1D cluster -------------------------------------------

UCX = {"UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo"}
CLUSTER = "top-1p1d"
NAMESPACE = "pdserve-top"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data") as server:
        yield server


def test_once_shows_a_worker_whose_metrics_do_not_answer_as_unreachable(etcd, capsys):
    from pdserve.cluster.records import WorkerInfo
    from pdserve.cluster.registry import Registry

    cluster = f"top-unreach-{uuid.uuid4().hex[:6]}"
    dead = f"127.0.0.1:{free_loopback_port()}"

    async def go():
        async with Registry([etcd.endpoint], cluster) as reg, Registry([etcd.endpoint], cluster) as reg2:
            await reg.register(WorkerInfo("prefill-9", "prefill", endpoints={"metrics": dead}))
            await reg2.register(WorkerInfo("decode-9", "decode", endpoints={"grpc": dead}))
            return await asyncio.to_thread(main, ["top", "--etcd", etcd.endpoint, "--cluster", cluster, "--once",
                                                  "--interval", "0.1"])

    assert asyncio.run(go()) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.startswith("prefill-9 ")).split()
    assert row[:3] == ["prefill-9", "prefill", "unreachable"]
    assert f"prefill-9: /metrics http://{dead}/metrics: ConnectError" in out
    assert "decode-9: /metrics (none in its record): its etcd record names no /metrics endpoint" in out


class PrefillThread:
    """A PrefillWorker on a private event loop in this process."""

    def __init__(self, cfg: dict):
        from pdserve.prefill.worker import PrefillWorker

        self.worker = PrefillWorker(cfg)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="top-prefill-loop", daemon=True)

    def start(self) -> "PrefillThread":
        self._thread.start()
        self.call(self.worker.start, 180)
        return self

    def call(self, fn, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout_s)

    def stop(self) -> None:
        try:
            self.call(self.worker.stop, 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


@pytest.fixture(scope="module")
def cluster(etcd, llama_dir):
    import ray

    from pdserve.decode.worker import DecodeWorkerConfig
    from tests.harness import WorkerThread, start_local_ray, wait_until

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(NAMESPACE)
    common = dict(model=llama_dir, etcd_endpoints=[etcd.endpoint], cluster=CLUSTER, lease_ttl_s=3, ucx_env=UCX,
                  queue_name="top-queue", queue_namespace=NAMESPACE)
    d = p = None
    try:
        d = WorkerThread(DecodeWorkerConfig(worker_id="decode-0", remote_prefill=True, remote_timeout_s=60,
                                            **common)).start()
        p = PrefillThread(dict(worker_id="prefill-0", **common)).start()
        wait_until(lambda: d.worker.frontend.prefill_view.pool_size == 1 and d.worker.remote.available(), 30)
        yield SimpleNamespace(decode=d, prefill=p, etcd=etcd)
    finally:
        if p is not None:
            p.stop()
        if d is not None:
            d.stop()
        ray.shutdown()


class Tmux:
    """A tmux server of this test's own (private socket, no user config)."""

    def __init__(self):
        self.socket = f"pdserve-top-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout

    def pane(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def _row(pane: str, worker_id: str) -> list[str] | None:
    return next((ln.split() for ln in pane.splitlines() if ln.startswith(f"{worker_id} ")), None)


def await_pane(tmux: Tmux, pred, timeout_s: float, what: str) -> str:
    """The first capture of the pane for which `pred` holds (AssertionError with the last one)."""
    from tests.harness import wait_until

    shown = {"pane": ""}

    def check() -> bool:
        shown["pane"] = tmux.pane()
        return bool(pred(shown["pane"]))

    try:
        wait_until(check, timeout_s, 0.2)
    except TimeoutError:
        raise AssertionError(f"{what} not shown within {timeout_s:g} s; the pane:\n{shown['pane']}") from None
    return shown["pane"]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (tests/prereqs.sh installs it)")
def test_top_in_a_real_terminal_shows_both_workers_updates_and_quits_on_q(cluster, tmp_path):
    from pdserve.api import Client
    from tests.harness import wait_until

    rc_file = tmp_path / "rc"
    cmd = (f"cd {REPO} && {sys.executable} -m pdserve.cli top --etcd {cluster.etcd.endpoint} --cluster {CLUSTER} "
           f"--interval 0.5 2> {tmp_path}/stderr; echo $? > {rc_file}")
    tmux = Tmux()
    try:
        tmux("new-session", "-d", "-x", "160", "-y", "40", "-s", "top", cmd)

        def both_up(pane: str) -> bool:
            rows = [_row(pane, w) for w in ("decode-0", "prefill-0")]
            return all(r is not None and r[2] == "up" and r[-1] != "-" for r in rows)

        first = await_pane(tmux, both_up, 60, "both workers up")
        assert _row(first, "decode-0")[1] == "decode" and _row(first, "prefill-0")[1] == "prefill"
        done0 = int(_row(first, "decode-0")[-1])
        assert first.startswith("pdserve top  (q quits)") and f"cluster {CLUSTER}" in first

        with Client(cluster.decode.grpc) as c:
            out = c.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True, route="local",
                             priority="high")
        assert len(out.token_ids) == 4

        later = await_pane(tmux, lambda pane: (_row(pane, "decode-0") or [""])[-1] == str(done0 + 1), 30,
                           "the request counted")
        assert later != first
        assert re.search(r"routes, last 60 s: local 1 \(\w+ 1\)", later), later
        ttft = next(ln for ln in later.splitlines() if ln.startswith("  decode-0 ")).split()
        assert ttft[1] == "1" and ttft[2].endswith("ms"), later  # one TTFT in the window

        tmux("send-keys", "-t", "top", "q")
        wait_until(lambda: rc_file.is_file() and rc_file.read_text().strip() != "", 15, 0.1)
        assert rc_file.read_text().strip() == "0", (tmp_path / "stderr").read_text()
    finally:
        tmux.kill()
