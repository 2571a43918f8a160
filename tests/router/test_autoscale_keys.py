"""Every key of an autoscale policy, made wrong in turn, is refused naming that key and its line
(the planner refuses such a version on reload and keeps the one it has)."""

from __future__ import annotations

import pytest

from pdserve.router.loader import PolicyError, parse_autoscale

FULL = """\
autoscale:
  prefill:
    min_replicas: 1
    max_replicas: 4
    gpus_per_replica: 1
    scale_up: {queue_length: 8, gpu_utilization: 80, kv_cache_usage: 90}
    scale_down: {queue_length: 2, gpu_utilization: 40, kv_cache_usage: 20}
  decode:
    min_replicas: 1
    max_replicas: 4
    gpus_per_replica: 1
    scale_up: {queue_length: 16, gpu_utilization: 80, kv_cache_usage: 75}
    scale_down: {queue_length: 4, gpu_utilization: 30, kv_cache_usage: 30}
  mode: sla
  sla:
    ttft_ms: 1000
    itl_ms: 50
    max_utilization: 0.8
    hysteresis: 0.2
    prefill_tokens_per_s: 4000
    decode_seqs_per_worker: 32
  interval_s: 10
  cooldown_s: 60
  down_stable_s: 30
  max_step: 1
  gpu_budget: 16
  drain_timeout_s: 120
  start_timeout_s: 300
  allow_role_flip: true
"""


def leaves(text: str) -> list[tuple[str, int]]:
    """(dotted key, line) of every scalar key of FULL, including those in flow maps."""
    out, stack = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        indent = (len(line) - len(line.lstrip())) // 2
        key, _, rest = line.strip().partition(":")
        del stack[indent:]
        rest = rest.strip()
        if not rest:
            stack.append(key)
        elif rest.startswith("{"):
            for item in rest.strip("{}").split(","):
                out.append((".".join([*stack, key, item.split(":")[0].strip()]), lineno))
        else:
            out.append((".".join([*stack, key]), lineno))
    return out


def break_value(text: str, path: str, line: int, bad: str) -> str:
    lines = text.splitlines()
    leaf = path.rsplit(".", 1)[1]
    src = lines[line - 1]
    if "{" in src:
        head, _, body = src.partition("{")
        items = [i.strip() for i in body.rstrip("}").split(",")]
        items = [f"{leaf}: {bad}" if i.split(":")[0].strip() == leaf else i for i in items]
        lines[line - 1] = head + "{" + ", ".join(items) + "}"
    else:
        lines[line - 1] = src.split(":")[0] + f": {bad}"
    return "\n".join(lines) + "\n"


def test_the_full_document_is_valid():
    assert parse_autoscale(FULL).autoscale.sla.ttft_ms == 1000


@pytest.mark.parametrize("path,line", leaves(FULL), ids=[p for p, _ in leaves(FULL)])
def test_each_key_made_wrong_is_refused_with_its_path_and_line(path, line):
    bad = "maybe" if path.endswith("mode") else "[1, 2]"  # no key takes a list
    with pytest.raises(PolicyError) as info:
        parse_autoscale(break_value(FULL, path, line, bad), "a.yaml")
    issues = [(i.path, i.line) for i in info.value.issues]
    assert (path, line) in issues, (path, line, str(info.value))


@pytest.mark.parametrize("path,line", [(p, n) for p, n in leaves(FULL) if p.endswith(
    ("replicas", "_s", "budget", "max_step", "_ms", "queue_length"))])
def test_each_number_out_of_range_is_refused(path, line):
    with pytest.raises(PolicyError) as info:
        parse_autoscale(break_value(FULL, path, line, "-5"), "a.yaml")
    assert any(i.path == path and i.line == line for i in info.value.issues), str(info.value)


def test_a_misspelt_key_is_refused_with_a_suggestion():
    with pytest.raises(PolicyError) as info:
        parse_autoscale(FULL.replace("down_stable_s", "down_stabel_s"), "a.yaml")
    assert "a.yaml:24:3: autoscale.down_stabel_s: unknown key" in str(info.value)
    assert "did you mean 'down_stable_s'" in str(info.value)
