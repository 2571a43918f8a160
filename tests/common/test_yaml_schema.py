"""One YAML schema loader (common/yaml_schema.py) for the topology, the router policy and the
autoscale policy: every error names file, line, column and key path the same way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.cluster.topology import TopologyError, load_topology
from pdserve.common.yaml_schema import YamlDocument, YamlIssue, YamlSchemaError, parse_yaml
from pdserve.router.loader import PolicyError, load_autoscale_file, load_policy_file

REPO = Path(__file__).resolve().parents[2]

TOPOLOGY = """\
cluster: test
model: {path: auto}
roles:
  prefill: {replicas: 1}
  decode:
    replicas: 1
    remote_timeout_s: -1
"""
ROUTER = """\
router:
  mode: conditional
  cost_model:
    ema_alpha: 0
"""
AUTOSCALE = """\
autoscale:
  interval_s: 5
  decode:
    max_replicas: 0
"""


@pytest.mark.parametrize("text, load, error, where, field", [
    (TOPOLOGY, load_topology, TopologyError, "7:5", "roles.decode.remote_timeout_s"),
    (ROUTER, load_policy_file, PolicyError, "4:5", "router.cost_model.ema_alpha"),
    (AUTOSCALE, load_autoscale_file, PolicyError, "4:5", "autoscale.decode.max_replicas"),
], ids=["topology", "router", "autoscale"])
def test_a_bad_field_of_each_file_kind_names_file_line_column_and_field(tmp_path, text, load, error, where,
                                                                        field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(error) as info:
        load(path)
    assert isinstance(info.value, YamlSchemaError)
    assert str(info.value).startswith(f"{path}:{where}: {field}: Input should be greater than")
    issue = info.value.issues[0]
    assert (issue.path, f"{issue.line}:{issue.column}") == (field, where)


def test_an_unknown_key_of_each_file_kind_names_its_place_and_the_allowed_keys(tmp_path):
    cases = [
        (TOPOLOGY.replace("remote_timeout_s: -1", "replica: 2"), load_topology, "7:5: roles.decode.replica"),
        (ROUTER.replace("ema_alpha: 0", "ema_alfa: 0.5"), load_policy_file, "4:5: router.cost_model.ema_alfa"),
        (AUTOSCALE.replace("max_replicas: 0", "max_replica: 3"), load_autoscale_file,
         "4:5: autoscale.decode.max_replica"),
    ]
    for text, load, where in cases:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(YamlSchemaError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}:{where}: unknown key"), message
        assert "(allowed: " in message and "did you mean" in message, message


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    size: int = Field(1, ge=1)


class Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Item] = []
    cpus: list[int] | str | None = None
    tags: dict[str, Item] = {}
    old: dict = {}
    total: int = 0

    @model_validator(mode="after")
    def _total_fits(self) -> "Doc":
        if self.total and self.total < len(self.items):
            raise ValueError(f"total: {self.total} is fewer than the {len(self.items)} items")
        return self


def error_of(text: str, **kwargs) -> YamlSchemaError:
    with pytest.raises(YamlSchemaError) as info:
        parse_yaml(text, "d.yaml", Doc, **kwargs)
    return info.value


def test_a_list_item_and_a_missing_key_point_at_the_item_and_at_the_section_lacking_it():
    err = error_of("items:\n  - {name: a}\n  - name: b\n    size: 0\n  - size: 2\n")
    assert [(i.path, i.line, i.column) for i in err.issues] == [
        ("items[1].size", 4, 5), ("items[2].name", 5, 5)]
    section = error_of("tags:\n  x:\n    size: 2\n")
    assert section.issues == [YamlIssue("tags.x.name", 2, "Field required", 3)]


def test_a_union_member_has_no_node_of_its_own():
    err = error_of("cpus: [0, x]\n")
    assert {(i.line, i.column) for i in err.issues if "[1]" in i.path} == {(1, 11)}


def test_a_whole_document_validator_naming_its_key_is_placed_at_that_key():
    err = error_of("items: [{name: a}, {name: b}]\ntotal: 1\n")
    assert err.issues == [YamlIssue("total", 2, "1 is fewer than the 2 items", 1)]


def test_unknown_keys_list_what_is_allowed_there_and_refused_keys_say_why():
    err = error_of("tags:\n  x: {name: a, colour: red}\nold_key: 1\n", refused={("old_key",): "gone: delete it"})
    assert [i.format("d.yaml") for i in err.issues] == [
        "d.yaml:2:16: tags.x.colour: unknown key 'colour' (allowed: name, size); check its spelling and indentation",
        "d.yaml:3:1: old_key: gone: delete it",
    ]


def test_duplicate_keys_broken_yaml_and_a_list_at_the_top_are_errors_with_their_place():
    assert str(error_of("total: 1\ntotal: 2\n")) == "d.yaml:2:1: total: duplicate key (only one may appear)"
    assert str(error_of("items: [a\n")).startswith("d.yaml:2:1: invalid YAML: ")
    assert str(error_of("- 1\n")) == "d.yaml:1:1: top level must be a mapping of keys"
    assert YamlDocument("# nothing\n", "d.yaml").validate(Doc) == Doc()  # empty: all defaults


def test_policy_check_reads_autoscale_files_without_the_planner_imported():
    """No registry, no side-effect import: the router's command imports the schema it reads."""
    code = ("import sys; from pdserve.router import cli; "
            f"rc = cli.main(['policy', 'check', {str(REPO / 'configs/autoscale/default.yaml')!r}]); "
            "assert rc == 0, rc; assert 'pdserve.cluster' not in sys.modules, 'the router imported the cluster'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "default.yaml: OK (autoscale policy)" in run.stdout
