"""The router policy a worker decides with, and the cost model calibrated from its measurements.

A policy is swapped in whole, in one assignment, and only once validated, so a request never
sees half of an old and half of a new policy; an invalid one is refused, logged with the
router's key + line message, and counted. No I/O: where the policy text comes from (a file
watched for changes, an etcd key) is the caller's (decode/policy_state.py for the decode
worker; the simulator's decode worker, sim/decode_sim.py, holds a fixed policy).
"""

from __future__ import annotations

import logging

from pdserve.router.costs import CostModel
from pdserve.router.loader import PolicyError, parse_policy
from pdserve.router.policy import DEFAULT_POLICY, RouterPolicy

log = logging.getLogger(__name__)


class RouterState:
    """Current `RouterPolicy` plus the `CostModel` calibrated from measurements."""

    def __init__(self, kv_bytes_per_token: int, policy: RouterPolicy = DEFAULT_POLICY, source: str = "<default>"):
        self.policy: RouterPolicy = policy
        self.costs = CostModel(policy.router.cost_model, kv_bytes_per_token)
        self.version = 1
        self.source = source
        self.last_error: str | None = None
        self.num_rejected = 0

    def apply_text(self, text: str, source: str) -> bool:
        """Validate and swap in a policy; on error keep the old one. Returns success."""
        try:
            policy = parse_policy(text, source=source)
        except PolicyError as exc:
            self.last_error = str(exc)
            self.num_rejected += 1
            log.error("router policy from %s refused, keeping version %d: %s", source, self.version, exc)
            return False
        self.set(policy, source)
        return True

    def set(self, policy: RouterPolicy, source: str) -> None:
        """Swap in an already validated policy (one assignment)."""
        self.costs.update_params(policy.router.cost_model)
        self.policy = policy
        self.version += 1
        self.source = source
        self.last_error = None
        log.info("router policy version %d active (from %s)", self.version, source)

    def reject(self, message: str) -> None:
        """Record a refusal that happened elsewhere (the etcd watch's validator)."""
        self.last_error = message
        self.num_rejected += 1
        log.error("router policy refused, keeping version %d: %s", self.version, message)
