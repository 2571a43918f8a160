"""The planner's decisions as pure functions: thresholds, SLA sizing, hysteresis and every bound.

Observations are built as the workers publish them (cluster/load.py keys in etcd records),
two snapshots apart, and go through the same `observe` the planner uses.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.planner.decide import Memory, decide, decode_step_model, learn
from pdserve.cluster.planner.observe import Snapshot, observe
from pdserve.cluster.planner.policy import parse_autoscale

THRESHOLD = """\
autoscale:
  prefill:
    min_replicas: 1
    max_replicas: 3
    scale_up: {queue_length: 8, gpu_utilization: 80}
    scale_down: {queue_length: 2, gpu_utilization: 40}
  decode:
    min_replicas: 1
    max_replicas: 4
    scale_up: {queue_length: 16, kv_cache_usage: 75}
    scale_down: {queue_length: 4, kv_cache_usage: 30}
  interval_s: 1
  cooldown_s: 30
  down_stable_s: 0
  max_step: 1
  gpu_budget: 6
"""

SLA = """\
autoscale:
  mode: sla
  sla: {ttft_ms: 1000, itl_ms: 50, max_utilization: 0.8, hysteresis: 0.25}
  prefill: {min_replicas: 1, max_replicas: 8}
  decode: {min_replicas: 1, max_replicas: 8}
  interval_s: 1
  cooldown_s: 0
  down_stable_s: 0
  max_step: 4
  gpu_budget: 16
"""


def policy(text=THRESHOLD, **overrides):
    for key, value in overrides.items():
        text = text.replace(f"  {key}: ", f"  {key}: {value} #", 1)
    return parse_autoscale(text).autoscale


def snapshots(prefill: list[dict], decode: list[dict], queue: dict, dt: float = 10.0, prev_prefill=None,
              prev_decode=None, prev_queue=None) -> tuple[Snapshot, Snapshot]:
    """(previous, current) with the given per-worker loads; counters in `prev_*` (default zeros)."""
    def workers(p, d):
        out = {f"prefill-{i}": {"role": "prefill", "load": ld} for i, ld in enumerate(p)}
        out.update({f"decode-{i}": {"role": "decode", "load": ld} for i, ld in enumerate(d)})
        return out

    zero_p = [{"busy_s": 0, "tokens": 0, "tasks": 0}] * len(prefill)
    zero_d = [{"busy_s": 0, "requests": 0, "output_tokens": 0, "prompt_tokens": 0, "decode_steps": 0,
               "decode_ms": 0, "decode_seqs": 0}] * len(decode)
    prev = Snapshot(1000.0, prev_queue or {"depth": 0, "queued_tokens": 0},
                    workers(prev_prefill or zero_p, prev_decode or zero_d))
    return prev, Snapshot(1000.0 + dt, queue, workers(prefill, decode))


def run_decide(pol, prev, cur, memory=None, current=None, now=2000.0, units=None):
    obs = observe(prev, cur)
    memory = memory or Memory()
    learn(memory, obs)
    current = current or {"prefill": len(obs.prefill.workers), "decode": len(obs.decode.workers)}
    return {d.role: d for d in decide(pol, obs, memory, current=current, units=units or {"prefill": 1, "decode": 1},
                                      now=now)}


def idle_decode(n=1):
    return [{"running": 0, "waiting": 0, "kv_usage": 0.1, "busy_s": 0.5}] * n


def test_any_up_threshold_scales_up_and_names_it():
    prev, cur = snapshots([{"busy_s": 1.0, "tokens": 100, "tasks": 1, "kv_usage": 0.1}], idle_decode(),
                          {"depth": 9, "queued_tokens": 9000})
    d = run_decide(policy(), prev, cur)
    assert (d["prefill"].action, d["prefill"].desired, d["prefill"].reason) == ("up", 2, "threshold_up")
    assert any("scale_up.queue_length: 9 >= 8 (holds)" in line for line in d["prefill"].explanation)
    assert d["prefill"].figures["utilization"] == 10.0  # 1 busy second in 10
    assert d["decode"].action == "down" or d["decode"].action == "hold"


def test_down_needs_every_down_threshold():
    busy = [{"busy_s": 5.0, "tokens": 100, "tasks": 1}] * 2  # 50% busy: above the 40% down threshold
    prev, cur = snapshots(busy, idle_decode(), {"depth": 0, "queued_tokens": 0})
    d = run_decide(policy(), prev, cur)
    assert (d["prefill"].action, d["prefill"].reason) == ("hold", "steady")
    quiet = [{"busy_s": 1.0, "tokens": 100, "tasks": 1}] * 2
    prev, cur = snapshots(quiet, idle_decode(), {"depth": 0, "queued_tokens": 0})
    d = run_decide(policy(), prev, cur)
    assert (d["prefill"].action, d["prefill"].desired, d["prefill"].reason) == ("down", 1, "threshold_down")


def test_cooldown_blocks_an_action_and_says_so():
    prev, cur = snapshots([{"busy_s": 9.0, "tokens": 100, "tasks": 1}], idle_decode(), {"depth": 20, "queued_tokens": 1})
    memory = Memory(last_action_at={"prefill": 1990.0})
    d = run_decide(policy(), prev, cur, memory=memory, now=2000.0)
    assert (d["prefill"].action, d["prefill"].reason) == ("hold", "cooldown")
    assert any("cooldown" in line and "10 s ago" in line for line in d["prefill"].explanation)
    d = run_decide(policy(), prev, cur, memory=Memory(last_action_at={"prefill": 1960.0}), now=2000.0)
    assert d["prefill"].action == "up"


def test_max_replicas_and_budget_bound_a_scale_up():
    prev, cur = snapshots([{"busy_s": 9.5, "tokens": 1, "tasks": 1}] * 3, idle_decode(), {"depth": 50, "queued_tokens": 1})
    d = run_decide(policy(), prev, cur)
    assert (d["prefill"].action, d["prefill"].reason) == ("hold", "at_max")
    # Budget: 2 prefill x 2 units + 1 decode x 2 units = 6 of 6: no room for a third prefill.
    prev, cur = snapshots([{"busy_s": 9.5, "tokens": 1, "tasks": 1}] * 2, idle_decode(), {"depth": 50, "queued_tokens": 1})
    d = run_decide(policy(), prev, cur, units={"prefill": 2, "decode": 2})
    assert (d["prefill"].action, d["prefill"].reason) == ("hold", "budget")
    assert any("gpu_budget 6" in line for line in d["prefill"].explanation)


def test_below_min_is_repaired_even_in_cooldown():
    prev, cur = snapshots([], idle_decode(), {"depth": 0, "queued_tokens": 0})
    d = run_decide(policy(), prev, cur, memory=Memory(last_action_at={"prefill": 1999.0}))
    assert (d["prefill"].action, d["prefill"].desired, d["prefill"].reason) == ("up", 1, "below_min")


def test_decode_step_model_fits_a_line_and_falls_back_to_proportional():
    points = [[b, 5.0 + 0.5 * b] for b in (1, 2, 4, 8, 16)]
    fixed, per_seq = decode_step_model(points)
    assert abs(fixed - 5.0) < 1e-6 and abs(per_seq - 0.5) < 1e-6
    fixed, per_seq = decode_step_model([[4.0, 20.0], [4.2, 21.0]])  # no spread: proportional
    assert fixed == 0.0 and abs(per_seq - 41.0 / 8.2) < 1e-9


def sla_load(rate_rps: float, out_tokens: int = 100, dt: float = 10.0, decode_workers: int = 1):
    """A decode pool that served `rate_rps` requests/s of `out_tokens`, with a measured step-time line."""
    requests = rate_rps * dt
    per = [{"running": 0, "waiting": 0, "kv_usage": 0.2, "busy_s": 5.0, "requests": requests / decode_workers,
            "output_tokens": requests * out_tokens / decode_workers, "prompt_tokens": 0, "decode_steps": 100,
            "decode_ms": 100 * (5.0 + 1.0 * 8), "decode_seqs": 800}] * decode_workers
    prefill = [{"busy_s": 5.0, "tokens": 20000, "tasks": 20}]  # 4000 tokens per busy second
    return snapshots(prefill, per, {"depth": 0, "queued_tokens": 0}, dt=dt)


def test_sla_mode_sizes_decode_from_littles_law_and_shows_its_figures():
    pol = policy(SLA)
    memory = Memory(decode_points=[[2.0, 7.0], [16.0, 21.0]])  # step = 5 ms + 1 ms per sequence
    low = run_decide(pol, *sla_load(1.0), memory=memory)
    assert low["decode"].desired == 1
    memory = Memory(decode_points=[[2.0, 7.0], [16.0, 21.0]])
    high = run_decide(pol, *sla_load(40.0), memory=memory)
    f = high["decode"].figures
    # 40 req/s x 100 tokens x 50 ms = 200 sequences; a worker holds (50-5)/1 = 45 at the ITL
    # target, planned at 80%: 36 -> ceil(200/36) = 6; max_step 4 takes it from 1 to 5.
    assert abs(f["littles_law_sequences"] - 200.0) < 1e-6, f
    assert f["worker_sequences_at_itl"] == 45.0 and f["need"] == 6, f
    assert (high["decode"].action, high["decode"].desired) == ("up", 5)
    text = "\n".join(high["decode"].explanation)
    assert "need = ceil(200.0 sequences / 36.0 per worker) = 6" in text and "max_step 4" in text


def test_sla_mode_sizes_prefill_from_the_ttft_target():
    pol = policy(SLA)
    # 4000 tokens per busy second, tasks of 1000 tokens: 250 ms each, so at a 1 s TTFT target
    # a worker may run 75% busy (below max_utilization 0.8): 3000 tokens/s per worker.
    prev, cur = snapshots([{"busy_s": 5.0, "tokens": 20000, "tasks": 20}], idle_decode(),
                          {"depth": 30, "queued_tokens": 10000}, prev_queue={"depth": 0, "queued_tokens": 0})
    d = run_decide(pol, prev, cur, memory=Memory(decode_points=[[1, 6], [8, 13]]))["prefill"]
    f = d.figures
    assert f["worker_tokens_per_busy_s"] == 4000.0 and f["target_utilization"] == 0.75, f
    # demand: 2000 served + 1000 backlog growth + 10000 queued / 1 s = 13000 tokens/s
    assert f["demand_tokens_per_s"] == 13000.0 and f["need"] == 5, f
    assert (d.action, d.desired) == ("up", 5)


def test_sla_without_any_capacity_figure_holds_and_says_why():
    pol = policy(SLA)
    prev, cur = snapshots([{"busy_s": 0, "tokens": 0, "tasks": 0}], idle_decode(), {"depth": 3, "queued_tokens": 300})
    d = run_decide(pol, prev, cur)
    assert (d["prefill"].action, d["prefill"].reason) == ("hold", "no_capacity_yet")
    assert "no prefill capacity measured yet" in d["prefill"].explanation[0]


def test_sla_hysteresis_keeps_a_flapping_load_from_oscillating():
    """Load flapping +-10% around the point where 3 decode workers become 2: with 25%
    hysteresis the planner scales down once it is clearly low, then never back and forth."""
    pol = policy(SLA)
    memory = Memory(decode_points=[[2.0, 7.0], [16.0, 21.0]])
    # 2 workers hold 2 x 36 = 72 sequences; 72 / 2 req/s x ... rate r gives 5 r sequences (100 tok x 50 ms).
    current = {"prefill": 1, "decode": 3}
    actions = []
    for i in range(40):
        rate = 14.4 * (1.1 if i % 2 else 0.9)  # demand 64.8 .. 79.2 sequences around 72
        obs = observe(*sla_load(rate, decode_workers=current["decode"]))
        memory.decode_points = [[2.0, 7.0], [16.0, 21.0]]
        d = {x.role: x for x in decide(pol, obs, memory, current=current, units={"prefill": 1, "decode": 1},
                                       now=2000.0 + i)}["decode"]
        if d.action != "hold":
            actions.append((i, d.action, d.desired))
            current["decode"] = d.desired
    assert len(actions) <= 1, actions  # no up-down-up
    assert all(a[1] != "down" or a[2] >= 2 for a in actions), actions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.floats(0, 1), st.floats(0, 1)), min_size=5, max_size=40),
       st.integers(1, 3), st.integers(0, 20), st.integers(3, 8))
def test_bounds_hold_under_any_load_sequence(loads, max_step, cooldown, budget):
    """Whatever the load: never above max_replicas or the budget, at most max_step per
    decision, and no two actions of a role within cooldown_s."""
    pol = parse_autoscale(THRESHOLD.replace("max_step: 1", f"max_step: {max_step}")
                          .replace("cooldown_s: 30", f"cooldown_s: {cooldown}")
                          .replace("gpu_budget: 6", f"gpu_budget: {budget}")).autoscale
    memory, current, now = Memory(), {"prefill": 1, "decode": 1}, 0.0
    last = {}
    rng = random.Random(0)
    for depth, busy, kv in loads:
        now += 1.0 + rng.random() * 5
        prev, cur = snapshots([{"busy_s": 0.0, "tokens": 0, "tasks": 0}] * current["prefill"],
                              [{"running": 1, "waiting": depth, "kv_usage": kv, "busy_s": 0}] * current["decode"],
                              {"depth": depth, "queued_tokens": depth * 100}, dt=10.0,
                              prev_prefill=None)
        for w in cur.workers.values():
            if w["role"] == "prefill":
                w["load"] = {"busy_s": 10.0 * busy, "tokens": 0, "tasks": 0}
        obs = observe(prev, cur)
        for d in decide(pol, obs, memory, current=dict(current), units={"prefill": 1, "decode": 1}, now=now):
            role_pol = getattr(pol, d.role)
            assert d.desired <= role_pol.max_replicas and abs(d.step) <= max_step
            if d.action != "hold":
                if d.reason != "below_min":
                    assert d.role not in last or now - last[d.role] >= cooldown, (d, last)
                last[d.role] = now
                memory.last_action_at[d.role] = now
                current[d.role] = d.desired
        assert current["prefill"] + current["decode"] <= max(budget, 2)


FLIP = """\
autoscale:
  prefill:
    min_replicas: 0
    max_replicas: 2
    scale_up: {queue_length: 4, gpu_utilization: 70}
    scale_down: {queue_length: 0, gpu_utilization: 10}
  decode:
    min_replicas: 1
    max_replicas: 2
    scale_up: {gpu_utilization: 60}
    scale_down: {gpu_utilization: 5}
  interval_s: 1
  cooldown_s: 5
  down_stable_s: 0
  max_step: 1
  gpu_budget: 2
  allow_role_flip: {flip}
"""


def test_an_idle_role_and_a_saturated_one_within_the_budget_flip_a_worker():
    idle_prefill = [{"busy_s": 0.0, "tokens": 0, "tasks": 0}]
    busy_decode = [{"running": 30, "waiting": 0, "kv_usage": 0.4, "busy_s": 9.0}]
    prev, cur = snapshots(idle_prefill, busy_decode, {"depth": 0, "queued_tokens": 0})
    d = run_decide(policy(FLIP.replace("{flip}", "true")), prev, cur)
    assert (d["prefill"].action, d["prefill"].reason, d["decode"].action, d["decode"].reason) == (
        "down", "role_flip", "up", "role_flip")
    assert d["decode"].figures["flip"] == 1
    assert any("role flip: 1 prefill worker(s) move to decode" in line for line in d["decode"].explanation)
    # Without flips: the same load is a plain drain of the prefill worker and a start of a decode one.
    d = run_decide(policy(FLIP.replace("{flip}", "false")), prev, cur)
    assert (d["prefill"].reason, d["decode"].reason) == ("threshold_down", "threshold_up")
    assert "flip" not in d["decode"].figures


def test_a_scale_down_waits_until_the_down_condition_has_held_for_down_stable_s():
    pol = policy(THRESHOLD.replace("down_stable_s: 0", "down_stable_s: 20"))
    quiet = [{"busy_s": 1.0, "tokens": 100, "tasks": 1}] * 2
    prev, cur = snapshots(quiet, idle_decode(), {"depth": 0, "queued_tokens": 0})
    memory = Memory()
    first = run_decide(pol, prev, cur, memory=memory, now=2000.0)["prefill"]
    assert (first.action, first.reason) == ("hold", "stabilizing")
    assert any("down_stable_s 20" in line for line in first.explanation)
    assert run_decide(pol, prev, cur, memory=memory, now=2015.0)["prefill"].reason == "stabilizing"
    # A busy reading in between restarts the clock.
    busy_prev, busy_cur = snapshots([{"busy_s": 5.0, "tokens": 100, "tasks": 1}] * 2, idle_decode(),
                                    {"depth": 0, "queued_tokens": 0})
    assert run_decide(pol, busy_prev, busy_cur, memory=memory, now=2016.0)["prefill"].action == "hold"
    assert run_decide(pol, prev, cur, memory=memory, now=2030.0)["prefill"].reason == "stabilizing"
    assert run_decide(pol, prev, cur, memory=memory, now=2049.0)["prefill"].reason == "stabilizing"
    done = run_decide(pol, prev, cur, memory=memory, now=2050.5)["prefill"]
    assert (done.action, done.desired) == ("down", 1)


def test_gpu_utilization_comes_from_nvml_when_every_worker_reports_it():
    prev, cur = snapshots([{"busy_s": 1.0, "tokens": 0, "tasks": 0, "gpu_util": 0.9}] * 2, idle_decode(),
                          {"depth": 0, "queued_tokens": 0})
    d = run_decide(policy(), prev, cur)["prefill"]
    assert d.figures["utilization"] == 90.0 and d.figures["utilization_source"] == "nvml"
    assert d.action == "up"  # 90% >= 80 by NVML, though the engine loop was busy 10%
    cur.workers["prefill-1"]["load"].pop("gpu_util")  # one worker without NVML: the busy fraction for all
    assert run_decide(policy(), prev, cur)["prefill"].figures["utilization_source"] == "busy"


def test_gpu_load_is_empty_on_cpu():
    from pdserve.cluster.load import gpu_load

    assert gpu_load("cpu") == {}
