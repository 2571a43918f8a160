"""Hypothesis profiles for the fuzz suite (loaded by conftest.py).

CI runs the "ci" profile: a fixed number of derandomized examples, so a run is
bounded in time and reproducible. Locally, ``PDSERVE_FUZZ=deep`` draws fresh
random examples, ten times as many (``PDSERVE_FUZZ_EXAMPLES=N`` sets the count).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_deep = os.environ.get("PDSERVE_FUZZ") == "deep"
_examples = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "0")) or None
_common = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
               database=None)
settings.register_profile("ci", derandomize=True, **_common)
settings.register_profile("deep", derandomize=False, **_common)
settings.load_profile("deep" if _deep else "ci")


def examples(ci: int) -> int:
    """How many examples a property gets: ``ci`` in CI, 10x with PDSERVE_FUZZ=deep."""
    return _examples or (ci * 10 if _deep else ci)
