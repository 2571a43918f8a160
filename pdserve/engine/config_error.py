"""`ConfigError`, in a module of its own: what reads a model directory without running it (the
tokenizer, a gateway's prompt checks) raises it without importing torch."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""
