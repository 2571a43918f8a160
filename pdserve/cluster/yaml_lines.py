"""Errors that name the YAML line: where a key sits in a composed YAML node tree.

Used by the topology loader: a pydantic error's location becomes "key: line", a
model-level validator's "roles.x.ports.y: ..." message finds its own key's line, and
duplicate keys (which PyYAML keeps silently, last one winning) are errors.
"""

from __future__ import annotations

import re

import yaml


def issue_of(root: yaml.Node, err: dict) -> tuple[str, int | None, str]:
    loc = tuple(err["loc"])
    msg = err["msg"]
    # Model-level validators put the key in their message ("roles.x.ports.y: ..."): use it.
    m = re.match(r"^(?:Value error, )?([\w.]+): (.*)$", msg) if not loc else None
    if m:
        key = m.group(1)
        return key, line_of(root, tuple(key.split("."))), m.group(2)
    msg = msg.removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key (check its spelling and indentation)"
    key = ".".join(str(p) for p in loc) or "(top level)"
    return key, line_of(root, loc), msg


def line_of(root: yaml.Node | None, loc: tuple) -> int | None:
    """1-based line of the deepest node along `loc` (the parent's, for a missing key)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line if line is not None else (root.start_mark.line + 1 if root is not None else None)


def duplicate_keys(node: yaml.Node | None, loc: tuple) -> list[tuple[str, int | None, str]]:
    """PyYAML keeps the last of two equal keys silently; a typo'd copy must be an error."""
    issues = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                issues.append((".".join((*loc, key)), key_node.start_mark.line + 1, "duplicate key"))
            seen.add(key)
            issues += duplicate_keys(value_node, (*loc, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += duplicate_keys(item, (*loc, str(i)))
    return issues
