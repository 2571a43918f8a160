"""YAML text -> validated policy, or a PolicyError naming key path and line.

Parsing is pure (text in, policy or error out); only ``load_*_file`` touch
the filesystem. The YAML is composed into a node tree first so that every
schema error can be mapped back to the line of the offending key or value;
the same walk rejects duplicate keys, which plain ``yaml.safe_load`` would
silently resolve to the last one.
"""

from __future__ import annotations

import difflib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.router.policy import NOT_YET_USED, RouterPolicy

M = TypeVar("M", bound=BaseModel)
# Other kinds of policy document, by the top-level key that marks them: kind -> (key, parser).
# The router's own kind is the default. The planner registers its autoscale policy
# (pdserve.cluster.planner.policy) when imported; the router never imports the planner.
_KINDS: dict[str, tuple[str, Callable[[str, str], Any]]] = {}


@dataclass(frozen=True)
class PolicyIssue:
    """One problem found in a policy document."""

    path: str  # dotted key path, e.g. "router.threshold.prefill_queue_max"
    line: int | None  # 1-based line in the source, when known
    message: str


class PolicyError(ValueError):
    """A policy document that cannot be used; ``issues`` lists every problem.

    ``str()`` is one line per issue, ``SOURCE:LINE: key.path: message``, so it
    can be printed as-is by ``pdserve policy check`` or a reload log line.
    """

    def __init__(self, source: str, issues: list[PolicyIssue]):
        self.source = source
        self.issues = issues
        super().__init__("\n".join(self._format(i) for i in issues))

    def _format(self, issue: PolicyIssue) -> str:
        where = f"{self.source}:{issue.line}" if issue.line is not None else self.source
        key = f"{issue.path}: " if issue.path else ""
        return f"{where}: {key}{issue.message}"


# --- public API --------------------------------------------------------------


def parse_policy(yaml_text: str, source: str = "<string>") -> RouterPolicy:
    """Parse and validate a router policy document."""
    return parse_model(yaml_text, source, RouterPolicy)


def register_kind(kind: str, top_key: str, parser: Callable[[str, str], Any]) -> None:
    """Let `detect_kind` / `parse_any` / `load_any_file` (and `pdserve policy check`) read another
    kind of policy document: one whose top level has `top_key`, parsed by `parser(text, source)`."""
    _KINDS[kind] = (top_key, parser)


def detect_kind(yaml_text: str, source: str = "<string>") -> str:
    """The registered kind whose top-level key the document has (``autoscale``), else ``router``."""
    data, _ = _compose(yaml_text, source)
    if isinstance(data, dict):
        for kind, (key, _) in _KINDS.items():
            if key in data:
                return kind
    return "router"


def parse_any(yaml_text: str, source: str = "<string>") -> Any:
    """Parse a document of any registered kind (see ``detect_kind``)."""
    kind = detect_kind(yaml_text, source)
    return parse_policy(yaml_text, source) if kind == "router" else _KINDS[kind][1](yaml_text, source)


def load_policy_file(path: str | Path) -> RouterPolicy:
    """Read and validate a router policy file."""
    path = Path(path)
    return parse_policy(path.read_text(encoding="utf-8"), str(path))


def load_any_file(path: str | Path) -> Any:
    """Read and validate a policy file of any registered kind."""
    path = Path(path)
    return parse_any(path.read_text(encoding="utf-8"), str(path))


# --- internals ---------------------------------------------------------------


def parse_model(yaml_text: str, source: str, model: type[M]) -> M:
    """YAML text -> a validated `model`, or a PolicyError naming each key path and its line
    (the parser of every policy kind: the router's, and the planner's autoscale policy)."""
    data, root = _compose(yaml_text, source)
    if data is None:
        data = {}  # an empty document (or only comments) is the all-defaults policy
    if not isinstance(data, dict):
        raise PolicyError(source, [PolicyIssue("", _line(root), "top level must be a mapping of keys")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        issues = [_issue(err, root, model) for err in exc.errors()]
        issues.sort(key=lambda i: (i.line is None, i.line or 0))
        raise PolicyError(source, issues) from None


def _compose(yaml_text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """YAML syntax check, node tree (for lines) and plain data, or PolicyError."""
    try:
        root = yaml.compose(yaml_text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(yaml_text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(source, [PolicyIssue("", line, f"invalid YAML: {problem}")]) from None
    duplicates = list(_duplicate_keys(root, ()))
    if duplicates:
        raise PolicyError(source, duplicates)
    return data, root


def _duplicate_keys(node: yaml.Node | None, path: tuple) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = str(key.value)
            if name in seen:
                issues.append(
                    PolicyIssue(_dotted((*path, name)), _line(key), "duplicate key (only one may appear)")
                )
            seen.add(name)
            issues.extend(_duplicate_keys(value, (*path, name)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues.extend(_duplicate_keys(item, (*path, i)))
    return issues


def _issue(err: dict, root: yaml.Node | None, model: type[BaseModel]) -> PolicyIssue:
    loc = tuple(err["loc"])
    line = _line(_node_at(root, loc))
    if err["type"] == "extra_forbidden":
        if model is RouterPolicy and loc in NOT_YET_USED:
            return PolicyIssue(_dotted(loc), line, NOT_YET_USED[loc])
        return PolicyIssue(_dotted(loc), line, _unknown_key_message(model, loc))
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    elif "input" in err and not isinstance(err["input"], (dict, list)):
        message += f" (got {err['input']!r})"
    return PolicyIssue(_dotted(loc), line, message)


def _node_at(root: yaml.Node | None, loc: tuple) -> yaml.Node | None:
    """The deepest node along a pydantic error location (key node for the last step)."""
    node = root
    for i, step in enumerate(loc):
        if isinstance(node, yaml.MappingNode) and isinstance(step, str):
            match = next(((k, v) for k, v in node.value if str(k.value) == step), None)
            if match is None:
                return node  # a missing key: point at the mapping that lacks it
            key, value = match
            # The last step points at its key's line: for a scalar that is
            # the value's line too, for a section it is its header line.
            node = key if i == len(loc) - 1 else value
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            node = node.value[step]
        else:
            return node
    return node


def _line(node: yaml.Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def _dotted(loc: tuple) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _unknown_key_message(model: type[BaseModel], loc: tuple) -> str:
    parent = _model_at(model, loc[:-1])
    if parent is None:
        return "unknown key"
    allowed = list(parent.model_fields)
    message = f"unknown key {loc[-1]!r} (allowed: {', '.join(allowed)})"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The schema model that a location (minus list indexes) points into."""
    current: Any = model
    for step in loc:
        if isinstance(step, int):
            continue
        field = current.model_fields.get(step) if _is_model(current) else None
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if _is_model(current) else None


def _unwrap(annotation: Any) -> Any:
    """list[X] / X | None -> X, so the walk can continue into X."""
    while get_origin(annotation) in (list, Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if not args:
            break
        annotation = args[0]
    return annotation


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
