"""The stop-string hold-back (engine/stops.py) equals the definition it replaces: the longest
suffix of the text so far that is a prefix of some stop string, fed in arbitrary pieces."""

from __future__ import annotations

import random

from pdserve.engine.stops import StopAutomaton, automaton_for


def longest_suffix_that_starts_a_stop(text: str, stops: list[str]) -> int:
    longest = max(map(len, stops))
    for n in range(min(len(text), longest), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def test_hold_back_equals_the_definition_on_random_text():
    rng = random.Random(7)
    for trial in range(2000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 5))]
        auto, state, text = StopAutomaton(tuple(stops)), 0, ""
        for _ in range(40):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            text += piece
            if any(s in text for s in stops):  # the detokenizer stops at a full match (str.find)
                break
            state = auto.feed(state, piece)
            assert auto.depth[state] == longest_suffix_that_starts_a_stop(text, stops), (stops, text)


def test_the_limits_worst_case_is_one_state_per_character():
    """32 stops of 256 characters sharing a 255-character prefix: a text that keeps almost
    matching moves one state per character (the slicing check compared ~8,000 tails: 4 ms a token)."""
    stops = tuple("a" * 255 + chr(ord("b") + i) for i in range(32))
    auto = automaton_for(stops)
    assert len(auto.goto) == 1 + 255 + 32
    state = auto.feed(0, "a" * 300)
    assert auto.depth[state] == 255
    state = auto.feed(state, "!")
    assert auto.depth[state] == 0
    assert automaton_for(stops) is auto  # shared by requests with the same stops
