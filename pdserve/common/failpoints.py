"""Failpoints: faults a chaos run injects into live workers, by name, off unless asked for.

A worker process reads ``PDSERVE_FAILPOINTS`` (comma-separated names) once, at import. The
chaos soak (bench/chaos.py) sets it in the environment of the Ray head it starts, so every
worker of that cluster has the failpoints on; nothing else sets it, and with it unset every
check below is one test of an empty frozenset. Like etcd's and TiKV's failpoints, they put a
fault at the exact place it would strike for real, so the product's own failure path handles it:

- ``request.poison``: a request whose prompt starts with `POISON_PREFIX` fails in the engine
  when its first token is appended (llm_engine `append_token`), the per-request failure path a
  detokenizer bug takes (`fail_request`: that request fails, the batch goes on). Every decode
  worker fails it alike: the poison request a gateway must not let empty its pool.
- ``prefill.hang_compute``: the prefill worker's actor method `hang_compute(seconds)` blocks
  its compute thread for that long while its event loop (and heartbeat) goes on: a hung step.
"""

from __future__ import annotations

import os

ENV = "PDSERVE_FAILPOINTS"
ENABLED = frozenset(name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip())
KNOWN = ("request.poison", "prefill.hang_compute")
# Token ids no generated chaos prompt starts with (they draw from 3..vocab at random).
POISON_PREFIX = (5, 7, 5, 7, 5, 7, 5, 7)


class FailpointError(RuntimeError):
    """A fault injected on purpose (its message names the failpoint)."""


def enabled(name: str) -> bool:
    return name in ENABLED


def check_poison(prompt_token_ids) -> None:
    """Raise FailpointError for a poison prompt when ``request.poison`` is on."""
    if "request.poison" in ENABLED and tuple(prompt_token_ids[:len(POISON_PREFIX)]) == POISON_PREFIX:
        raise FailpointError("failpoint request.poison: this request fails in the engine on every worker")
