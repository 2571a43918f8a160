"""The per-tenant token bound (router/qos.py `admit_tenant_tokens`, `tenant_token_limit`):
what a tenant's calls claim is their prompts + max_tokens of every sequence, so a call of
many sequences with a large max_tokens counts for what it may hold, not as one request."""

from __future__ import annotations

import pytest

from pdserve.router import (DEFAULT_POLICY, PolicyError, TokenLimit, admit_tenant_tokens, parse_policy,
                             tenant_token_limit)


def test_the_default_is_twice_the_workers_kv_pool_and_a_set_value_wins():
    assert DEFAULT_POLICY.qos.max_tokens_per_tenant is None
    pool = tenant_token_limit(DEFAULT_POLICY.qos, 350_000)
    assert pool.tokens == 2_800_000 and "null: 8 x this worker's KV pool of 350000 tokens" in pool.source
    assert tenant_token_limit(DEFAULT_POLICY.qos, None) is None  # nothing known: no bound
    q = parse_policy("qos:\n  max_tokens_per_tenant: 4096\n").qos
    assert tenant_token_limit(q, 350_000) == TokenLimit(4096, "qos.max_tokens_per_tenant 4096")


@pytest.mark.parametrize("value", [0, -5, "4096", 1.5])
def test_a_bad_value_is_refused_naming_the_key(value):
    with pytest.raises(PolicyError) as ei:
        parse_policy(f"qos:\n  max_tokens_per_tenant: {value!r}\n".replace("'", '"'))
    assert "max_tokens_per_tenant" in str(ei.value)


def test_a_128_sequence_call_with_a_large_max_tokens_counts_far_more_than_one_sequence():
    limit = TokenLimit(100_000, "qos.max_tokens_per_tenant 100000")
    prompt = 50
    one = prompt + 1 * 2000
    fan_out = prompt + 128 * 2000  # a prompt's samples share its blocks: the prompt counts once
    assert admit_tenant_tokens(0, one, limit).ok
    refused = admit_tenant_tokens(0, fan_out, limit, "50 prompt tokens + 128 sequences x max_tokens 2000")
    assert not refused.ok and refused.retry_after_ms is None  # alone over the limit: waiting never helps
    assert refused.detail.startswith("this call claims 256050 tokens (50 prompt tokens + 128 sequences")
    assert "qos.max_tokens_per_tenant 100000" in refused.detail and "lower max_tokens" in refused.detail
    assert admit_tenant_tokens(0, prompt + 128 * 10, limit).ok  # the same fan-out with a small max_tokens


def test_a_call_that_fits_alone_waits_for_its_tenants_other_calls():
    limit = TokenLimit(2000, "qos.max_tokens_per_tenant 2000")
    assert admit_tenant_tokens(1000, 1000, limit).ok  # equal to the limit: admitted
    over = admit_tenant_tokens(1001, 1000, limit)
    assert not over.ok and over.retry_after_ms == 1000
    assert "beside the 1001 its tenant's calls in flight claim" in over.detail and "retry in ~1000 ms" in over.detail
