"""Workers use the engine only through its public API and the remote-KV seam (engine/kv_connector.py).

decode/ and prefill/ (and api/, the surfaces a decode worker serves) may call `LLMEngine`'s
public methods (make_request, add_request, abort_request, step, load, has_work, release, ...)
and `engine.connector`; they must
not reach into the scheduler, the KV manager, the block pool, the model runner or a
request's bookkeeping. This test reads their source: it fails on any such attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("decode", "prefill", "api")
# Engine internals (attribute names of LLMEngine, Request, KVCacheManager and BlockPool).
FORBIDDEN = {
    "scheduler", "kv", "pool", "runner", "sampler", "requests", "_detok", "_append",  # LLMEngine's parts
    "keep_kv", "num_computed_tokens", "output_token_ids", "all_token_ids", "generator",  # Request's
    "rename", "reserve_remote", "release_reservation", "tables", "cache_full_blocks",  # KV manager's
    "add_remote", "remote_failed",  # scheduler calls (the connector's job)
}


def offenders(root: Path = ROOT) -> list[str]:
    found = []
    for folder in WORKERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN :
                    found.append(f"{rel}:{node.lineno}: .{node.attr}")
    return found


def test_workers_touch_no_engine_internals():
    assert offenders() == [], "use LLMEngine's public API or engine.connector (engine/kv_connector.py)"


def test_the_check_sees_an_internal_access(tmp_path):
    """The scan itself works: a worker file that reaches into the scheduler is caught."""
    (tmp_path / "decode").mkdir()
    (tmp_path / "prefill").mkdir()
    (tmp_path / "decode" / "bad.py").write_text("def f(eng):\n    return eng.scheduler.remote\n")
    assert offenders(tmp_path) == ["decode/bad.py:2: .scheduler"]
