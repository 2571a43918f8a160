"""YAML text -> validated policy (router or autoscale), or a PolicyError naming each problem's
file, line, column and key path.

Both kinds are read by the one YAML schema loader (common/yaml_schema.py, which the topology
uses too); this module names the kinds and what is special to them (``NOT_YET_USED``). Parsing
is pure (text in, policy or error out); only ``load_*_file`` touch the filesystem.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.common.yaml_schema import YamlDocument, YamlIssue, YamlSchemaError, parse_yaml
from pdserve.router.autoscale import AutoscalePolicy
from pdserve.router.policy import NOT_YET_USED, RouterPolicy

PolicyIssue = YamlIssue  # one problem found in a policy document


class PolicyError(YamlSchemaError):
    """A policy document that cannot be used; ``issues`` lists every problem.

    ``str()`` is one line per issue, ``SOURCE:LINE:COLUMN: key.path: message``, so it can be
    printed as-is by ``pdserve policy check`` or a reload log line.
    """


def parse_policy(yaml_text: str, source: str = "<string>") -> RouterPolicy:
    """Parse and validate a router policy document."""
    return parse_yaml(yaml_text, source, RouterPolicy, error=PolicyError, refused=NOT_YET_USED)


def parse_autoscale(yaml_text: str, source: str = "<string>") -> AutoscalePolicy:
    """Parse and validate an autoscale policy document."""
    return parse_yaml(yaml_text, source, AutoscalePolicy, error=PolicyError)


def detect_kind(yaml_text: str, source: str = "<string>") -> str:
    """``autoscale`` when the document has a top-level ``autoscale`` key, else ``router``."""
    data = YamlDocument(yaml_text, source, PolicyError).data
    return "autoscale" if isinstance(data, dict) and "autoscale" in data else "router"


def parse_any(yaml_text: str, source: str = "<string>") -> RouterPolicy | AutoscalePolicy:
    """Parse a policy document of either kind (see ``detect_kind``)."""
    if detect_kind(yaml_text, source) == "autoscale":
        return parse_autoscale(yaml_text, source)
    return parse_policy(yaml_text, source)


def load_policy_file(path: str | Path) -> RouterPolicy:
    """Read and validate a router policy file."""
    path = Path(path)
    return parse_policy(path.read_text(encoding="utf-8"), str(path))


def load_autoscale_file(path: str | Path) -> AutoscalePolicy:
    """Read and validate an autoscale policy file."""
    path = Path(path)
    return parse_autoscale(path.read_text(encoding="utf-8"), str(path))


def load_any_file(path: str | Path) -> RouterPolicy | AutoscalePolicy:
    """Read and validate a policy file of either kind."""
    path = Path(path)
    return parse_any(path.read_text(encoding="utf-8"), str(path))
