"""Markers the engine tests share."""

from __future__ import annotations

import pytest

from pdserve.engine.tp_comm import shm_available

# TP 2+ on the CPU: its collectives need shared memory (/dev/shm) this host may not offer.
needs_shm = pytest.mark.skipif(shm_available() is not None, reason=f"shm collectives unavailable: {shm_available()}")
