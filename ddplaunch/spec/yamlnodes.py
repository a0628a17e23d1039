"""Where things are in a composed YAML document: lines of key paths, the nodes along a pattern,
and which unquoted scalars YAML would turn into something else. Used by spec/load.py to name
the line of every problem."""
from __future__ import annotations

from typing import Any, Optional

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ddplaunch.spec.yamlsafe import CORE_TAG, Constructor, Problem, show


def node_at(root: Optional[Node], loc: tuple[Any, ...]) -> tuple[int, Optional[Node]]:
    """The 1-based line of the deepest node along `loc` (the key itself when present) and the
    node reached at the end of `loc` (None when `loc` leaves the document)."""
    node, line = root, 1
    if node is not None:
        line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, MappingNode):
            for key, value in node.value:
                if isinstance(key, ScalarNode) and key.value == str(part):
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line, None
        elif isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line, None
    return line, node


def nodes_along(root: Optional[Node], pattern: str) -> list[tuple[tuple[Any, ...], int, Node]]:
    """(loc, line, node) of every node the document has along a dotted `pattern`: `*` is every
    key of a mapping, `name[]` every item of the list at `name`; line is the key's (or item's)."""
    found: list[tuple[tuple[Any, ...], int, Node]] = [((), 1, root)] if root is not None else []
    for part in pattern.split("."):
        name, each = part.removesuffix("[]"), part.endswith("[]")
        step: list[tuple[tuple[Any, ...], int, Node]] = []
        for loc, _, node in found:
            if not isinstance(node, MappingNode):
                continue
            step += [(loc + (k.value,), k.start_mark.line + 1, v) for k, v in node.value
                     if isinstance(k, ScalarNode) and (name == "*" or k.value == name)]
        if each:
            step = [(loc + (i,), item.start_mark.line + 1, item) for loc, _, seq in step
                    if isinstance(seq, SequenceNode) for i, item in enumerate(seq.value)]
        found = step
    return found


def replace_at(data: Any, loc: tuple[Any, ...], value: Any) -> None:
    """Put `value` at `loc` in constructed data, where that place exists (else do nothing)."""
    for part in loc[:-1]:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(data, dict) and loc[-1] in data or \
            isinstance(data, list) and isinstance(loc[-1], int) and loc[-1] < len(data):
        data[loc[-1]] = value


def coercion(node: Optional[Node]) -> Optional[str]:
    """For a plain (unquoted) scalar that YAML turns into a non-string whose str() differs
    from the text, `'TEXT would become VALUE'`; else None (`1` and `1.5` stay as written)."""
    if not isinstance(node, ScalarNode) or node.style or node.tag == CORE_TAG + "str":  # libyaml: style ""
        return None
    try:
        value = Constructor().construct_object(node, deep=True)
    except (Problem, yaml.YAMLError):
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)) and str(value) == node.value:
        return None
    shown = "true" if value is True else "false" if value is False else "null" if value is None else value
    if value is None and node.value:
        return f"{show(node.value, 60)} means no value"
    text = node.value if node.value else "an empty value"
    return f"{show(text, 60)} would become {show(shown, 60)}"
