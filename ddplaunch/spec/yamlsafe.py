"""Safe, bounded YAML loading: any bytes under any path end in data or one `SpecError` line.

`load_yaml(path)` reads at most `MAX_BYTES`, insists on UTF-8 without control characters, and
composes the document with libyaml's parser (pure-Python fallback) under limits on nesting depth
and alias expansion, rejecting duplicate keys, unknown tags, NUL in strings and huge integers.
It returns the constructed data together with the composed node tree, which spec/model.py uses to
name lines (`node_at`) and to spot plain scalars that YAML coerced (`coercion`).
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

from ddplaunch.errors import SpecError

LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))
# A spec is a few kB. libyaml scans 1 MiB in well under a second; pure Python, 128 KiB.
MAX_BYTES = 1 << 20 if LIBYAML else 128 << 10
MAX_DEPTH = 32  # nesting levels, aliases expanded (a real spec needs 4)
MAX_NODES = 10_000  # values (scalars, lists, mappings), those reached through aliases counted as
#                    if written out: a 1,000-host spec has 7,000; composing is ~20 us a value
#: Characters of text the document holds with every alias written out: a file of MAX_BYTES holds
#: at most that much; aliases may repeat some of it, not turn 50 kB into 90 MB
MAX_EXPANDED = 2 * MAX_BYTES
#: CPU seconds reading a document may take before it is refused (a spec is read in milliseconds;
#: CPU time, not wall time: a loaded machine does not refuse a good spec)
MAX_LOAD_S = 2.0
MAX_INT_BITS = 64
MAX_FLOAT_CHARS = 100
MAX_MESSAGE_BYTES = 4000
MAX_SHOWN = 200  # characters of a path, key or value quoted in a message

CORE_TAG = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {CORE_TAG + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")}
# Control characters (tab, LF and CR aside) and YAML's other line breaks: never in a spec file.
_BAD_CHAR = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\ufffe\uffff]")
_LONG_INT = re.compile(r"[-+]?[0-9][0-9_]*")
_CHAR_NAMES = {0: "NUL", 0x1b: "ESC", 0x7f: "DEL", 0x85: "NEL", 0x0b: "VT", 0x0c: "FF"}


@dataclass(frozen=True)
class LoadedYaml:
    """A document read by `load_yaml`: the constructed data and its composed node tree."""

    data: Any
    root: Optional[Node]
    shown: str  # the path as messages show it (escaped, shortened)


def show(value: Any, limit: int = MAX_SHOWN) -> str:
    """`value` as one printable line of at most about `limit` characters (for messages)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = f"{text[:limit // 2]}...{text[-(limit // 2):]}"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(message: str) -> str:
    """The final form of every SpecError message: one printable line under 4 kB."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message[:MAX_MESSAGE_BYTES * 2])
    data = text.encode("utf-8", "backslashreplace")
    if len(data) > MAX_MESSAGE_BYTES:
        text = data[:MAX_MESSAGE_BYTES - 20].decode("utf-8", "ignore") + " ...(shortened)"
    return text


def char_name(char: str) -> str:
    """`U+0000 (NUL)` style name of a control character."""
    code = ord(char)
    name = _CHAR_NAMES.get(code) or ("LF" if char == "\n" else "CR" if char == "\r" else "TAB" if char == "\t"
                                     else "control character")
    return f"U+{code:04X} ({name})"


# --------------------------------------------------------------------------- reading


def read_text(path: Union[str, Path], what: str = "cluster spec") -> tuple[str, str]:
    """The decoded text of `path` (a `what`: cluster spec, hostfile) and its shown name; every
    failure is one SpecError.

    Raises:
        SpecError: unusable path, missing/unreadable/non-regular/oversized file, not UTF-8, or a
            control character in the text (named with line:column).
    """
    raw = os.fsdecode(os.fspath(path))
    shown = show(raw)
    spec = what == "cluster spec"
    noun, example = ("spec file", " such as cluster.yaml") if spec else (what, "")
    if not raw:
        raise SpecError("(empty path): pass the path of a cluster spec such as cluster.yaml")
    if "\0" in raw:
        raise SpecError(f"{shown}: the path contains a NUL character; pass a real file name")
    try:
        fd = os.open(raw, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SpecError(f"{shown}: no such file; pass the path of a {what}{example}") from None
    except OSError as err:
        raise SpecError(f"{shown}: cannot read: {err.strerror or err}") from None
    except ValueError:  # e.g. a lone surrogate that no file system name can hold
        raise SpecError(f"{shown}: not a usable file name") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SpecError(f"{shown}: is a directory; pass the {noun} inside it")
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(f"{shown}: not a regular file; pass the path of a {what}{' file' if spec else ''}")
        if info.st_size > MAX_BYTES:
            raise SpecError(f"{shown}: {info.st_size} bytes; a spec may have at most {MAX_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as err:
        raise SpecError(f"{shown}: cannot read: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise SpecError(f"{shown}: more than {MAX_BYTES} bytes; a spec may have at most {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise SpecError(f"{shown}:{line}:{col}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                        f"{err.start}); save the file as UTF-8") from None
    text = text.removeprefix("\ufeff")
    bad = _BAD_CHAR.search(text)
    if bad:
        line, col = _line_col(text, bad.start())
        raise SpecError(f"{shown}:{line}:{col}: {char_name(bad.group())} in the file; remove it")
    return text, shown


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of `text[index]`, counting CRLF, CR and LF as YAML does."""
    before = text[:index]
    breaks = list(re.finditer(r"\r\n|\r|\n", before))
    start = breaks[-1].end() if breaks else 0
    return len(breaks) + 1, index - start + 1


# --------------------------------------------------------------------------- composing


class Problem(Exception):
    """A bounded-loading problem found while composing/constructing, with its mark."""

    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.mark, self.message = mark, message


class _Resolver(Resolver):
    """YAML 1.1 implicit types without timestamps and `=`: a spec never means a date."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag not in (CORE_TAG + "timestamp", CORE_TAG + "value")]
        for first, rules in Resolver.yaml_implicit_resolvers.items()
    }

    def resolve(self, kind: type, value: Any, implicit: Any) -> str:
        # A long plain scalar is text: the implicit-type regexes backtrack on megabyte inputs.
        if kind is ScalarNode and implicit[0] and len(value) > MAX_FLOAT_CHARS:
            return CORE_TAG + ("int" if _LONG_INT.fullmatch(value) else "str")
        return super().resolve(kind, value, implicit)


def _not_a(node: ScalarNode, what: str) -> "Problem":
    """An explicitly tagged scalar that is not what its tag says (`!!int "-"`, `!!bool maybe`)."""
    tag = node.tag.replace(CORE_TAG, "!!")
    return Problem(node.start_mark, f"{tag} {show(repr(node.value), 60)} is not {what}; remove the tag "
                                     "or write the value it names")


class Constructor(SafeConstructor):
    """SafeConstructor whose integers fit in 64 bits (Python refuses str() past 4300 digits), and
    whose tagged scalars that are not what the tag says (`!!int "-"`) are a problem with a line,
    not an exception."""

    def construct_yaml_int(self, node: ScalarNode) -> int:
        digits = node.value.replace("_", "")
        if len(digits) > MAX_INT_BITS + 3:  # 0b + 64 binary digits + sign is the longest in range
            raise Problem(node.start_mark, f"integer too large ({len(digits)} characters; at most "
                                            f"{MAX_INT_BITS} bits); quote it if it is text")
        try:
            value = super().construct_yaml_int(node)
        except (ValueError, IndexError):
            raise _not_a(node, "an integer") from None
        if value.bit_length() > MAX_INT_BITS:
            raise Problem(node.start_mark, f"integer too large (at most {MAX_INT_BITS} bits); "
                                            "quote it if it is text")
        return value

    def construct_yaml_float(self, node: ScalarNode) -> float:
        if len(node.value) > MAX_FLOAT_CHARS:
            raise Problem(node.start_mark, f"number too long ({len(node.value)} characters); "
                                            "quote it if it is text")
        try:
            return super().construct_yaml_float(node)
        except OverflowError:  # sexagesimal 1:2:3...:4.5 past a float's range
            raise Problem(node.start_mark, "number too large; quote it if it is text") from None
        except (ValueError, IndexError):
            raise _not_a(node, "a number") from None

    def construct_yaml_bool(self, node: ScalarNode) -> bool:
        if str(node.value).lower() not in self.bool_values:
            raise _not_a(node, "true or false")
        return super().construct_yaml_bool(node)


Constructor.add_constructor(CORE_TAG + "int", Constructor.construct_yaml_int)  # type: ignore[type-var]
Constructor.add_constructor(CORE_TAG + "float", Constructor.construct_yaml_float)  # type: ignore[type-var]
Constructor.add_constructor(CORE_TAG + "bool", Constructor.construct_yaml_bool)  # type: ignore[type-var]


class _BoundedComposer(Composer):
    """Composer with a depth limit, alias-expansion accounting and no recursive aliases."""

    peek_event: Callable[[], Any]  # the parser's, in the loader classes below

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._nodes = 0
        self._open_anchors: set[str] = set()
        self._measured: dict[int, tuple[int, int, int]] = {}
        self._chars = 0
        self._deadline = time.thread_time() + MAX_LOAD_S

    def _measure(self, node: Node) -> tuple[int, int, int]:
        """(size, height, characters) of `node` as if every alias in it were written out; size and
        characters saturate."""
        known = self._measured.get(id(node))
        if known is not None:
            return known
        size, height = 1, 1
        chars = len(node.value) if isinstance(node, ScalarNode) else 0
        children: list[Node] = []
        if isinstance(node, SequenceNode):
            children = node.value
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        for child in children:
            s, h, c = self._measure(child)
            size, height = min(size + s, MAX_NODES + 1), max(height, h + 1)
            chars = min(chars + c, MAX_EXPANDED + 1)
        self._measured[id(node)] = (size, height, chars)
        return size, height, chars

    def compose_node(self, parent: Optional[Node], index: Any) -> Node:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            if event.anchor in self._open_anchors:
                raise Problem(event.start_mark, f"alias *{show(event.anchor, 40)} is inside its own anchor "
                                                 "(a recursive structure); write the value out")
            node = self.anchors.get(event.anchor)
            if node is not None:
                size, height, chars = self._measure(node)
                self._nodes += size
                self._chars += chars
                if self._nodes > MAX_NODES:
                    raise Problem(event.start_mark, f"aliases expand to more than {MAX_NODES} values "
                                                     "in all (an alias bomb?); write the values out")
                if self._chars > MAX_EXPANDED:
                    raise Problem(event.start_mark, f"aliases expand to more than {MAX_EXPANDED} characters "
                                                     "of text in all (an alias bomb?); write the values out")
                if self._depth + height > MAX_DEPTH:
                    raise Problem(event.start_mark, f"alias *{show(event.anchor, 40)} nests values deeper "
                                                     f"than {MAX_DEPTH} levels")
            return _composed(super().compose_node(parent, index))
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise Problem(event.start_mark, f"more than {MAX_NODES} values; a spec needs far fewer")
        if self._nodes % 256 == 0 and time.thread_time() > self._deadline:
            raise Problem(event.start_mark, f"reading the spec took more than {MAX_LOAD_S:g} CPU-s; a spec is read "
                                             "in milliseconds: simplify it")
        if self._depth >= MAX_DEPTH:
            raise Problem(event.start_mark, f"values nested deeper than {MAX_DEPTH} levels")
        anchor = getattr(event, "anchor", None)
        if anchor is not None and anchor in self.anchors:
            first = self.anchors[anchor].start_mark.line + 1
            raise Problem(event.start_mark, f"anchor &{show(anchor, 40)} is defined twice (first at line "
                                             f"{first}); rename one")
        self._depth += 1
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.discard(anchor)
        node = _composed(node)
        if node.tag not in _ALLOWED_TAGS:
            raise Problem(node.start_mark, f"tag {show(node.tag.replace(CORE_TAG, '!!'), 60)} is not allowed "
                                            "in a spec; remove it")
        if isinstance(node, ScalarNode) and "\0" in node.value:
            raise Problem(node.start_mark, "NUL character in a value; remove it")
        return node


def _composed(node: Optional[Node]) -> Node:
    """A node the composer returned (always one while events remain)."""
    assert node is not None
    return node


def _loader_class(libyaml: bool = LIBYAML) -> type:
    """The loader: libyaml's C parser when PyYAML has it (every wheel does), else pure Python."""
    if libyaml:
        from yaml._yaml import CParser  # libyaml scans and parses; composing stays in Python

        class _CLoader(_BoundedComposer, CParser, Constructor, _Resolver):
            def __init__(self, stream: str) -> None:
                CParser.__init__(self, stream)
                _BoundedComposer.__init__(self)
                Constructor.__init__(self)
                _Resolver.__init__(self)

        return _CLoader
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _PyLoader(Reader, Scanner, Parser, _BoundedComposer, Constructor, _Resolver):
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            _BoundedComposer.__init__(self)
            Constructor.__init__(self)
            _Resolver.__init__(self)

    return _PyLoader


_Loader = _loader_class()


def load_yaml(path: Union[str, Path]) -> LoadedYaml:
    """Read, compose and construct the single YAML document at `path`, within the limits above.

    Returns:
        The data (None for an empty document), its node tree and the path as messages show it.

    Raises:
        SpecError: one line, `file:line[:col]: problem`, for anything `read_text` refuses, a YAML
            syntax error, nesting or alias expansion past the limits, a duplicate key (naming
            both lines), a tag other than YAML's core ones, NUL in a string or a huge integer.
    """
    text, shown = read_text(path)
    return parse_yaml(text, shown)


def parse_yaml(text: str, shown: str) -> LoadedYaml:
    """`load_yaml` of a document already in memory (`shown` names it in messages)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise SpecError(f"{shown}: more than {MAX_BYTES} bytes; a spec may have at most {MAX_BYTES} bytes")
    loader = _Loader(text)
    root: Optional[Node] = None
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_keys(loader, root, shown)
        data = loader.construct_document(root) if root is not None else None
    except Problem as p:
        key = _key_at(root, p.mark) if root is not None else None
        raise SpecError(f"{shown}:{p.mark.line + 1}:{p.mark.column + 1}: {f'{show(key)}: ' if key else ''}"
                        f"{p.message}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark else shown
        raise SpecError(f"{where}: YAML syntax error: {show(err.problem or err.context, 300)}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{shown}: YAML syntax error: {show(str(err).splitlines()[0] if str(err) else err, 300)}") from None
    finally:
        loader.dispose()
    return LoadedYaml(data, root, shown)


def _key_at(root: Node, mark: Any) -> Optional[str]:
    """The dotted key path of the value that starts at `mark` (`healthcheck.enabled`), if any."""
    stack: list[tuple[Node, tuple[Any, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if (node.start_mark.line, node.start_mark.column) == (mark.line, mark.column) and loc:
            return ".".join(str(p) for p in loc)
        if isinstance(node, SequenceNode):
            stack.extend((child, loc + (i,)) for i, child in enumerate(node.value))
        elif isinstance(node, MappingNode):
            stack.extend((value, loc + (key.value if isinstance(key, ScalarNode) else "?",))
                         for key, value in node.value)
    return None


def _check_keys(loader: Any, root: Node, shown: str) -> None:
    """Reject duplicate keys in every mapping (each node visited once), naming both lines."""
    seen: set[int] = set()
    stack: list[tuple[Node, tuple[Any, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            stack.extend((child, loc + (i,)) for i, child in reversed(list(enumerate(node.value))))
        elif isinstance(node, MappingNode):
            first: dict[Any, Node] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag != CORE_TAG + "merge":
                    key = loader.construct_object(key_node, deep=True)
                    try:
                        earlier = first.setdefault(key, key_node)
                    except TypeError:  # unhashable: the constructor says so
                        continue
                    if earlier is not key_node:
                        where = ".".join(str(p) for p in loc + (key,))
                        raise SpecError(f"{shown}:{key_node.start_mark.line + 1}: {show(where)}: duplicate key "
                                        f"{show(repr(key))} (first at line {earlier.start_mark.line + 1})")
            for key_node, value_node in reversed(node.value):
                key = key_node.value if isinstance(key_node, ScalarNode) else "?"
                stack.append((value_node, loc + (key,)))
