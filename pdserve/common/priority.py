"""One priority scale for the whole request path: API, router, queue, engine, both workers.

Lower is more urgent, so the value sorts directly (the queue's order, the
engine's priority scheduling and its preemption victim choice all sort on
it). On the wire (the queue's msgpack frames, JSON records) a priority
travels as its int; people and policy files use its name.
"""

from __future__ import annotations

from enum import IntEnum


class Priority(IntEnum):
    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        """The name users write: "high", "normal" or "low"."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: "Priority | str | int") -> "Priority":
        """A Priority from itself, its name (any case) or its int; ValueError naming the choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"priority {value!r}: use one of {', '.join(LABELS)} (or 0, 1, 2)")


LABELS = tuple(p.label for p in Priority)
