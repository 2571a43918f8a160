"""bench/prefix_cluster.py's client: a refused turn is retried as the OpenAI SDK retries a 429."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from bench.prefix_cluster import retry_delay_s


def refusal(code=grpc.StatusCode.RESOURCE_EXHAUSTED, hint: str | None = None) -> AioRpcError:
    trailers = Metadata(("retry-after-ms", hint)) if hint is not None else Metadata()
    return AioRpcError(code, Metadata(), trailers, details="the KV pool has 208 free token slots")


def test_a_refusal_waits_for_the_servers_hint():
    assert retry_delay_s(refusal(hint="350"), 0, 2) == pytest.approx(0.35)
    assert retry_delay_s(refusal(hint="350"), 1, 2) == pytest.approx(0.35)


def test_without_a_usable_hint_the_wait_doubles_and_is_capped():
    assert retry_delay_s(refusal(), 0, 9) == pytest.approx(0.5)
    assert retry_delay_s(refusal(), 2, 9) == pytest.approx(2.0)
    assert retry_delay_s(refusal(), 8, 9) == pytest.approx(8.0)
    assert retry_delay_s(refusal(hint="soon"), 1, 9) == pytest.approx(1.0)
    assert retry_delay_s(refusal(hint="120000"), 0, 9) == pytest.approx(0.5), "a hint over 60 s is not honoured"


def test_spent_retries_and_other_errors_are_not_retried():
    assert retry_delay_s(refusal(hint="100"), 2, 2) is None
    assert retry_delay_s(refusal(hint="100"), 0, 0) is None
    assert retry_delay_s(refusal(grpc.StatusCode.INVALID_ARGUMENT, "100"), 0, 2) is None
    assert retry_delay_s(RuntimeError("stream broke"), 0, 2) is None


def test_every_mode_runs_the_same_chats_with_the_same_pauses():
    """The pauses are part of the workload, drawn up front from the seed: a mode's order of
    replies must not decide which chat waits how long (it decided the run's length)."""
    from bench.prefix_cluster import make_chats, parse_args

    args = parse_args(["--chats", "5", "--turns", "4", "--think-s", "3"])
    a, b = make_chats(args, 1000), make_chats(args, 1000)
    assert [c["thinks"] for c in a] == [c["thinks"] for c in b]
    assert all(len(c["thinks"]) == 3 and all(t > 0 for t in c["thinks"]) for c in a)
    assert len({t for c in a for t in c["thinks"]}) == 15, "each pause is drawn, not one value reused"
    assert all(t == 0 for c in make_chats(parse_args(["--think-s", "0"]), 1000) for t in c["thinks"])
