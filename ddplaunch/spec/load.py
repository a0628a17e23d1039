"""Reading a cluster.yaml into a `ClusterSpec`: any bytes under any path end in a spec or one line.

`load_spec(path)` reads the file through the bounded loader of spec/yamlsafe.py, validates it with
the models of spec/model.py and maps every problem to one `SpecError` line under 4 kB,
`file:line: key.path: problem (hint)` — pydantic's errors with the YAML line they come from,
values YAML would silently coerce, keys the backend cannot honour (from its registration), local
paths that do not exist. With several problems: the first and `(and N more problems)`.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import MappingNode, Node

from ddplaunch.errors import SpecError
from ddplaunch.spec import registry
from ddplaunch.spec.examples import example_path, is_example
from ddplaunch.spec.hostfile import read_hostfile
from ddplaunch.spec.model import ClusterSpec, summarize_problems
from ddplaunch.spec.values import is_secret_name
from ddplaunch.spec.yamlnodes import coercion, node_at, nodes_along, replace_at
from ddplaunch.spec.yamlsafe import LoadedYaml, load_yaml, one_line, parse_yaml, show


# --------------------------------------------------------------------------- backend limits

def backend_limits(backend: str) -> dict[str, str]:
    """{key path -> why `backend` cannot honour it and what to do}: its registration's limits, and
    every section another backend owns. A key path is dotted; `hosts[]` means every host; a
    section name (`ssh`) means every key in that section."""
    limits = dict(registry.registration(backend).limits)
    for name in registry.names():
        if name != backend:
            for section in registry.registration(name).sections:
                limits.setdefault(section, f"only used by backend: {name}")
    return limits


def _backend_limit_problems(spec: ClusterSpec, root: Optional[Node], shown: str) -> list[tuple[int, str]]:
    """Keys the YAML sets to a value other than their default that the backend cannot honour."""
    problems = []
    for key_path, reason in backend_limits(spec.backend).items():
        for loc, line in _set_keys(root, key_path):
            value, default = _value_and_default(spec, loc)
            if value != default:
                problems.append((line, f"{shown}:{line}: {_dotted(loc)}: not supported by backend "
                                       f"'{spec.backend}' ({reason})"))
    return problems


def _set_keys(root: Optional[Node], key_path: str) -> list[tuple[tuple[Any, ...], int]]:
    """(loc, line) of every key the YAML sets along `key_path`; a section expands to its keys."""
    out = []
    for loc, line, node in nodes_along(root, key_path):
        if isinstance(node, MappingNode) and _section(loc):
            out += [(loc + sub, sub_line) for sub, sub_line, _ in nodes_along(node, "*")]
        else:
            out.append((loc, line))
    return out


def _section(loc: tuple[Any, ...]) -> bool:
    """Whether `loc` names a whole section of the spec (`ssh`, `slurm`, ...)."""
    field = ClusterSpec.model_fields.get(str(loc[0])) if len(loc) == 1 else None
    return field is not None and typing.get_origin(field.annotation) is None and _model_in(field.annotation) is not None


def _value_and_default(spec: ClusterSpec, loc: tuple[Any, ...]) -> tuple[Any, Any]:
    obj: Any = spec
    owner: Any = spec
    for part in loc:
        if isinstance(part, int):
            obj = obj[part]
        else:
            owner, obj = obj, getattr(obj, str(part), None)
    field = type(owner).model_fields.get(str(loc[-1]))
    return obj, (field.get_default(call_default_factory=True) if field else obj)


# --------------------------------------------------------------------------- loading


def load_spec(path: Union[str, Path]) -> ClusterSpec:
    """Read and validate a cluster spec file; any bytes under any path end here, bounded.

    Raises:
        SpecError: one line under 4 kB naming `file:line: key.path`, the problem and the fix; with
            several problems, the first and `(and N more problems)`.
    """
    try:
        return _load(load_yaml(path), Path(path).resolve().parent)
    except SpecError as err:
        raise SpecError(one_line(str(err))) from None


def load_spec_data(data: Mapping[str, Any], base_dir: Union[str, Path] = ".") -> ClusterSpec:
    """`load_spec` of a spec given as data (what a cluster.yaml holds), read exactly as a file
    would be; relative paths are taken from `base_dir`.

    Raises:
        SpecError: as `load_spec`, the spec named `<spec data>` and lines those of its YAML form.
    """
    try:
        text = yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True)
    except (yaml.YAMLError, TypeError, ValueError) as err:
        raise SpecError(f"<spec data>: not data a spec can hold ({type(err).__name__}: "
                        f"{show(str(err), 200)})") from None
    try:
        return _load(parse_yaml(text, "<spec data>"), Path(base_dir).resolve())
    except SpecError as err:
        raise SpecError(one_line(str(err))) from None


def _load(doc: LoadedYaml, base_dir: Path) -> ClusterSpec:
    shown, root = doc.shown, doc.root
    data = {} if doc.data is None else doc.data
    if not isinstance(data, dict):
        raise SpecError(f"{shown}:1: the spec must be a mapping of keys (name:, backend:, hosts: ...)")
    problems = _coercions(root, data, shown)
    if "base_dir" in data:  # a field of the model, never a key of the file
        line = node_at(root, ("base_dir",))[0]
        problems.append((line, f"{shown}:{line}: base_dir: unknown key 'base_dir'"))
        data = {k: v for k, v in data.items() if k != "base_dir"}
    data = _hosts_from_file(data, root, shown, base_dir)
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as err:
        problems += _describe(shown, root, err)
        spec = None
    if spec is not None:
        spec = spec.model_copy(update={"base_dir": str(base_dir)})
        problems += _backend_limit_problems(spec, root, shown)
    if problems or spec is None:  # a failed validation always brings at least one problem
        problems.sort(key=lambda p: p[0])
        raise SpecError(summarize_problems([msg for _, msg in problems]))
    _check_paths(spec, root, shown)
    return spec


def _hosts_from_file(data: dict[str, Any], root: Optional[Node], shown: str, base_dir: Path) -> dict[str, Any]:
    """`hosts: {file: PATH}` replaced by the hosts of that hostfile (spec/hostfile.py); PATH is taken
    from the spec file's directory."""
    hosts = data.get("hosts")
    if not isinstance(hosts, dict) or "file" not in hosts:
        return data
    line = node_at(root, ("hosts", "file"))[0]
    if set(hosts) != {"file"} or not isinstance(hosts["file"], str) or not hosts["file"]:
        raise SpecError(f"{shown}:{line}: hosts: a hostfile is given as `hosts: {{file: PATH}}` (a path, "
                        "nothing else)")
    try:
        path = base_dir / Path(hosts["file"]).expanduser()
    except RuntimeError:
        raise SpecError(f"{shown}:{line}: hosts.file: {show(hosts['file'])!r}: cannot expand ~; write the "
                        "full path") from None
    try:
        listed = read_hostfile(path)
    except SpecError as err:
        raise SpecError(f"{shown}:{line}: hosts.file: {err}") from None
    return {**data, "hosts": listed}


#: Where a string is meant and YAML's coercion of an unquoted value would change it (`*`: every
#: key of a mapping, `[]`: every item of a list) -> whether null is a valid value there.
#: Elsewhere pydantic's types already refuse coerced values.
COERCION_CHECKED = {"env.*": False, "env.*.value": False, "slurm.time": True, "job.args[]": False}


def _coercions(root: Optional[Node], data: dict[str, Any], shown: str) -> list[tuple[int, str]]:
    """Unquoted values that YAML would turn into something else (`010` -> 8, `on` -> true):
    refused with the quoted form to write. Their text replaces them so each is reported once."""
    problems = []
    for pattern, null_ok in COERCION_CHECKED.items():
        for loc, _, node in nodes_along(root, pattern):
            found = coercion(node)
            if found is None or null_ok and node.tag == "tag:yaml.org,2002:null":
                continue
            line = node.start_mark.line + 1
            if loc[0] == "env" and _secret_env(data, str(loc[1])):  # its value is never shown
                problems.append((line, f"{shown}:{line}: {_dotted(loc)}: YAML would read this unquoted value "
                                       "as another type and change it (the value is a secret: not shown); "
                                       "write it in quotes"))
            else:
                problems.append((line, f"{shown}:{line}: {_dotted(loc)}: {found}; write {_quoted(loc, node)}"))
            replace_at(data, loc, node.value)
    return problems


def _secret_env(data: dict[str, Any], name: str) -> bool:
    """Whether env entry `name` holds a secret: by its name, or marked so (`secret: true`, `from_env`)."""
    entry = (data.get("env") or {}).get(name) if isinstance(data.get("env"), dict) else None
    marked = isinstance(entry, dict) and (entry.get("secret") is True or "from_env" in entry)
    return is_secret_name(name) or marked


def _quoted(loc: tuple[Any, ...], node: Any) -> str:
    """`KEY: "TEXT"` (or `"TEXT"` for a list item): how to write a plain scalar as a string."""
    key = "" if isinstance(loc[-1], int) else f"{show(loc[-1])}: "
    return key + show(json.dumps(node.value, ensure_ascii=False), 120)


def _check_paths(spec: ClusterSpec, root: Optional[Node], shown: str) -> None:
    """Local paths ddplaunch expands must expand (`~nosuchuser`, names too long for the OS)."""
    paths: list[tuple[tuple[Union[str, int], ...], Optional[str]]] = [
        (("workdir",), spec.workdir), (("ssh", "key"), spec.ssh.key),
             (("ssh", "known_hosts"), spec.ssh.known_hosts), (("slurm", "conf"), spec.slurm.conf)]
    paths += [(("sync", i), p) for i, p in enumerate(spec.sync)]
    for loc, value in paths:
        if value is None:
            continue
        try:
            spec.resolve(value)
        except RuntimeError:
            raise SpecError(f"{shown}:{node_at(root, loc)[0]}: {_dotted(loc)}: {show(value)!r}: cannot expand "
                            "~ (no such user or no home directory); write the full path") from None
        if loc[0] == "sync" and not spec.resolve(value).exists():
            raise SpecError(f"{shown}:{node_at(root, loc)[0]}: {_dotted(loc)}: {show(value)!r}: no such file or "
                            f"directory ({show(str(spec.resolve(value)))}; relative paths are taken from the "
                            "spec file's directory)")
    try:
        workdir = spec.workdir_path
        script = Path(workdir) / spec.job.script
        if is_example(spec.job.script):
            example_path(spec.job.script)  # ValueError naming the shipped examples when unknown
            found = True
        else:
            found = not registry.registration(spec.backend).runs_here or script.is_file()
    except (OSError, ValueError, RuntimeError) as err:
        loc = ("job", "script") if spec.workdir is None else ("workdir",)
        raise SpecError(f"{shown}:{node_at(root, loc)[0]}: {_dotted(loc)}: cannot use this path: "
                        f"{getattr(err, 'strerror', None) or err}") from None
    if not found:
        raise SpecError(f"{shown}:{node_at(root, ('job', 'script'))[0]}: job.script: {show(spec.job.script)!r} "
                        f"not found in workdir {show(workdir)}; fix the path (relative to workdir)")


def _dotted(loc: tuple[Any, ...]) -> str:
    return show(".".join(str(p) for p in loc) or "(top level)")


_UNION_TAG = re.compile(r"^(?:int|str|float|bool|none|\[key\]|.*\[.*\])$")


def _describe(shown: str, root: Optional[Node], err: ValidationError) -> list[tuple[int, str]]:
    out, seen = [], set()
    for e in err.errors():
        keep_last = e["type"] == "extra_forbidden"
        loc = tuple(p for i, p in enumerate(e["loc"]) if (keep_last and i == len(e["loc"]) - 1)
                    or not (isinstance(p, str) and _UNION_TAG.match(p)))
        key_path = _dotted(loc)
        msg = e["msg"].removeprefix("Value error, ")
        line, node = node_at(root, loc)
        if e["type"] == "extra_forbidden":
            allowed = _fields_at(loc[:-1])
            msg = f"unknown key {show(repr(loc[-1]) if loc else '?')}"
            hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1) if loc else []
            msg += f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
        elif e["type"] == "string_type" and coercion(node) and loc:
            msg = f"{coercion(node)}; write {_quoted(loc, node)}"
        elif "input" in e and e["type"] not in ("missing", "value_error") and loc[:1] != ("env",):
            msg += f", got {show(repr(e['input']), 100)}"  # an env value may be a secret: never shown
        named = re.match(r"^([a-z_]+(?:\.[a-z_]+)*): ", msg) if not loc else None
        if named:  # model-level messages name their key themselves (`hosts: ...`)
            key_path, msg = named.group(1), msg[named.end():]
            line = node_at(root, tuple(key_path.split(".")))[0]
        if (key_path, msg) not in seen:
            seen.add((key_path, msg))
            out.append((line, f"{shown}:{line}: {key_path}: {msg}"))
    return out


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The allowed keys of the spec section at `loc` (for "did you mean")."""
    model: Any = ClusterSpec
    skip = False
    for part in loc:
        if skip or isinstance(part, int):
            skip = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        skip = typing.get_origin(field.annotation) is dict
        model = _model_in(field.annotation)
        if model is None:
            return []
    return [name for name in model.model_fields if name != "base_dir"]


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
