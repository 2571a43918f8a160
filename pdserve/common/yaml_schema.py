"""YAML text -> a validated pydantic model, or an error naming file, line, column and key path.

The one loader of every schema'd YAML file: the topology spec (cluster/topology.py), the
router policy and the autoscale policy (router/loader.py). Each issue reads

    SOURCE:LINE:COLUMN: key.path: message

The text is composed into a node tree first, so that every error of the schema maps back to
where its key sits; the same walk refuses duplicate keys, which ``yaml.safe_load`` would
silently resolve to the last one. An empty document is an empty mapping (a schema whose keys
all have defaults takes it as all defaults). Rules for the schemas behind it:

- a model-level validator of a section raises at that section's key;
- a validator of the whole document that names a key starts its message with it
  (``"queue.wire: 'loopback' serves ..."``): the issue is placed at that key;
- an unknown key is reported with the keys allowed there and the closest one.

Parsing is pure: text in, model or error out; reading the file is the caller's.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)
Loc = tuple[str | int, ...]  # a key path, as pydantic writes an error's location
Refused = Mapping[tuple[str, ...], str]  # key path -> why the schema refuses it
# A whole-document validator's message that starts with the key it is about.
_KEYED_MESSAGE = re.compile(r"^([\w.]+): (.*)$")


class YamlModel(BaseModel):
    """The base of every schema'd YAML file's models (the topology's sections, the router and
    autoscale policies): an unknown key is an error (reported with the keys allowed there),
    values are frozen once loaded. A schema that also refuses loose types (a string where a
    number goes) sets ``strict=True`` in its own ``model_config`` (the policies do)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class YamlIssue:
    """One problem found in a YAML document."""

    path: str  # dotted key path, e.g. "router.threshold.prefill_queue_max"; "" for the document
    line: int | None  # 1-based line in the source, when known
    message: str
    column: int | None = None  # 1-based column of the key (or item), when known

    def where(self, source: str) -> str:
        """``SOURCE:LINE:COLUMN``, as far as it is known."""
        if self.line is None:
            return source
        return f"{source}:{self.line}" + (f":{self.column}" if self.column is not None else "")

    def format(self, source: str) -> str:
        """The issue as one line: ``SOURCE:LINE:COLUMN: key.path: message``."""
        key = f"{self.path}: " if self.path else ""
        return f"{self.where(source)}: {key}{self.message}"


class YamlSchemaError(ValueError):
    """A YAML document that cannot be used; ``issues`` lists every problem, in line order.

    ``str()`` is one line per issue (``YamlIssue.format``), so it can be printed as is.
    """

    def __init__(self, source: str, issues: list[YamlIssue]):
        self.source = source
        self.issues = issues
        super().__init__("\n".join(issue.format(source) for issue in issues))


class YamlDocument:
    """One YAML text, composed: its data, its node tree (for positions) and its source name.

    Raises `error` (a `YamlSchemaError` class) on invalid YAML or a duplicate key.
    """

    def __init__(self, text: str, source: str, error: type[YamlSchemaError] = YamlSchemaError):
        self.source = source
        self.error = error
        try:
            self.root: yaml.Node | None = yaml.compose(text, Loader=yaml.SafeLoader)
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            what = ": ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
            issue = YamlIssue("", mark.line + 1 if mark else None, f"invalid YAML: {what or exc}",
                              mark.column + 1 if mark else None)
            raise error(source, [issue]) from None
        duplicates = _duplicate_keys(self.root, ())
        if duplicates:
            raise error(source, duplicates)
        self.data: Any = {} if data is None else data

    def issue(self, loc: Loc, message: str) -> YamlIssue:
        """An issue placed at the key `loc` names (the deepest of its keys that is written)."""
        line, column = _position(_locate(self.root, loc))
        return YamlIssue(_dotted(loc), line, message, column)

    def fail(self, issues: list[YamlIssue]) -> YamlSchemaError:
        """The document's error for `issues`, sorted by position (raise it)."""
        ordered = sorted(issues, key=lambda i: (i.line is None, i.line or 0, i.column or 0))
        return self.error(self.source, ordered)

    def validate(self, model: type[M], refused: Refused | None = None) -> M:
        """The document as a `model`, or raise its error naming every problem. `refused`: key
        paths the schema refuses with their own message instead of "unknown key"."""
        if not isinstance(self.data, dict):
            raise self.fail([self.issue((), "top level must be a mapping of keys")])
        try:
            return model.model_validate(self.data)
        except ValidationError as exc:
            raise self.fail([self._issue(err, model, refused or {}) for err in exc.errors()]) from None

    def _issue(self, err: Any, model: type[BaseModel], refused: Refused) -> YamlIssue:
        loc: Loc = tuple(err["loc"])
        raw: str = err["msg"]
        message = raw.removeprefix("Value error, ")  # a validator's own message: as written
        keyed = _KEYED_MESSAGE.match(message) if not loc else None
        if keyed:  # a whole-document validator naming its key: place the issue there
            return self.issue(tuple(keyed.group(1).split(".")), keyed.group(2))
        if err["type"] == "extra_forbidden":
            names = tuple(step for step in loc if isinstance(step, str))
            refusal = refused.get(names) if len(names) == len(loc) else None
            message = refusal if refusal is not None else _unknown_key_message(model, loc)
        elif message == raw and "input" in err and not isinstance(err["input"], (dict, list)):
            message += f" (got {err['input']!r})"
        return self.issue(loc, message)


def parse_yaml(text: str, source: str, model: type[M], *, error: type[YamlSchemaError] = YamlSchemaError,
               refused: Refused | None = None) -> M:
    """YAML text -> a validated `model`, or `error` naming each problem's place and key path."""
    return YamlDocument(text, source, error).validate(model, refused)


# --- where a key sits ---------------------------------------------------------------------


def _locate(root: yaml.Node | None, loc: Loc) -> yaml.Node | None:
    """The node an issue at `loc` is reported at: the key of a mapping entry, a list item; for a
    key that is not written, the key (or item) of the mapping that lacks it."""
    node, anchor = root, root
    for step in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(step, str):
            match = next(((k, v) for k, v in node.value if str(k.value) == step), None)
            if match is None:
                break
            anchor, node = match
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and 0 <= step < len(node.value):
            node = anchor = node.value[step]
        elif isinstance(step, str) and not isinstance(node, yaml.MappingNode):
            continue  # pydantic's name of a union's member ("list[int]"): no node of its own
        else:
            break
    return anchor


def _position(node: yaml.Node | None) -> tuple[int | None, int | None]:
    return (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (None, None)


def _dotted(loc: Loc) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _duplicate_keys(node: yaml.Node | None, loc: Loc) -> list[YamlIssue]:
    issues: list[YamlIssue] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = str(key.value)
            if name in seen:
                line, column = _position(key)
                issues.append(YamlIssue(_dotted((*loc, name)), line, "duplicate key (only one may appear)", column))
            seen.add(name)
            issues.extend(_duplicate_keys(value, (*loc, name)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues.extend(_duplicate_keys(item, (*loc, i)))
    return issues


# --- what is allowed where ----------------------------------------------------------------


def _unknown_key_message(model: type[BaseModel], loc: Loc) -> str:
    message = f"unknown key {loc[-1]!r}" if loc else "unknown key"
    parent = _model_at(model, loc[:-1])
    if parent is None:
        return message
    allowed = list(parent.model_fields)
    message += f" (allowed: {', '.join(allowed)})"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return message + (f"; did you mean {close[0]!r}?" if close else "; check its spelling and indentation")


def _model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The schema model that a location points into (list indexes and dict keys skipped)."""
    current: Any = model
    for step in loc:
        if isinstance(step, int):
            continue
        if get_origin(current) is dict:
            current = _unwrap(get_args(current)[1])
            continue
        field = current.model_fields.get(step) if _is_model(current) else None
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if _is_model(current) else None


def _unwrap(annotation: Any) -> Any:
    """list[X] / X | None / Annotated[X, ...] -> X, so the walk can continue into X."""
    while get_origin(annotation) in (list, Union, types.UnionType, Annotated):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if not args:
            break
        annotation = args[0]
    return annotation


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
