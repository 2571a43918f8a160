"""docs/api.md agrees with the code: its field tables and proto are what
`pdserve.api.reference` renders from the request models and the .proto."""

from __future__ import annotations

from pathlib import Path

from pdserve.api import openai_types
from pdserve.api.reference import BLOCK, REFERENCE, regenerate
from pdserve.api.ingress import ServingLimits

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_generated_blocks_are_current():
    page = PAGE.read_text()
    assert {m.group(2) for m in BLOCK.finditer(page)} == {"completions-fields", "chat-fields",
                                                         "chat-message-fields", "proto"}
    assert regenerate(page) == page, "run: python -m pdserve.api.reference docs/api.md"


def test_the_check_sees_a_stale_table():
    stale = PAGE.read_text().replace("| `echo` |", "| `echoes` |")
    assert regenerate(stale) != stale


def test_every_request_field_is_in_the_page():
    page = PAGE.read_text()
    models = openai_types.request_models(REFERENCE)
    for model in (models.completion, models.chat):
        for name in model.model_fields:
            assert f"| `{name}` |" in page, name


def test_every_serving_limit_is_in_the_page():
    page = PAGE.read_text()
    for name in ServingLimits.__dataclass_fields__:
        assert f"`{name}`" in page, name
