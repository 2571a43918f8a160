"""Loads the fuzz suite's Hypothesis profile (see profiles.py)."""

from tests.fuzz import profiles  # noqa: F401  (registers and loads the profile)
