"""The router policy a decode worker runs with, and its hot reload.

A reload (file change or etcd key) parses and validates the whole policy
first; only a valid policy replaces the current one, in one assignment, so a
request never sees half of an old and half of a new policy. An invalid one
is refused, logged with the router's key + line message, and counted.
"""

from __future__ import annotations

import asyncio
import logging
import os

from pdserve.router import CostModel, PolicyError, RouterPolicy, load_policy_file, parse_policy
from pdserve.router.policy import DEFAULT_POLICY

log = logging.getLogger(__name__)


class PolicyState:
    """Current `RouterPolicy` plus the `CostModel` calibrated from measurements."""

    def __init__(self, kv_bytes_per_token: int, policy: RouterPolicy | None = None, path: str | None = None):
        self.path = path
        if policy is None:
            policy = load_policy_file(path) if path else DEFAULT_POLICY
        self.policy: RouterPolicy = policy
        self.costs = CostModel(policy.router.cost_model, kv_bytes_per_token)
        self.version = 1
        self.source = path or "<default>"
        self.last_error: str | None = None
        self.num_rejected = 0
        self._mtime = os.stat(path).st_mtime_ns if path else None

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

    def check_file(self) -> bool | None:
        """Reload the policy file if it changed; None when unchanged."""
        if not self.path:
            return None
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            if self.last_error is None or "missing" not in self.last_error:
                self.last_error = f"{self.path}: policy file is missing; keeping version {self.version}"
                log.error(self.last_error)
            return False
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        with open(self.path) as f:
            return self.apply_text(f.read(), self.path)

    async def watch_file(self, interval_s: float = 1.0) -> None:
        """Poll the policy file for changes until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.check_file()
