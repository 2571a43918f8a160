"""The router policy a decode worker runs with, and its hot reload from the policy file.

`PolicyState` is the router's `RouterState` (router/state.py: the policy and the cost model,
swapped whole and only once validated) plus the file it was loaded from: a reload (file change,
or an etcd key through `apply_text`) parses and validates the whole policy first; an invalid
one is refused, logged with the router's key + line message, and counted.
"""

from __future__ import annotations

import asyncio
import logging
import os

from pdserve.router import RouterPolicy, load_policy_file
from pdserve.router.policy import DEFAULT_POLICY
from pdserve.router.state import RouterState

log = logging.getLogger(__name__)


class PolicyState(RouterState):
    """Current `RouterPolicy` plus the `CostModel` calibrated from measurements, and the policy
    file (``path``) they came from, reloaded when it changes."""

    def __init__(self, kv_bytes_per_token: int, policy: RouterPolicy | None = None, path: str | None = None):
        self.path = path
        if policy is None:
            policy = load_policy_file(path) if path else DEFAULT_POLICY
        super().__init__(kv_bytes_per_token, policy, path or "<default>")
        self._mtime = os.stat(path).st_mtime_ns if path else None

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
