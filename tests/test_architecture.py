"""The shape of the code: packages by stage, each importing only the packages below it (LAYERS),
no import circles in ddplaunch/ (lazy imports inside functions and imports for type checking count
too), a handful of modules at the top, no module over 500 lines and no function over 60, run
records import no backend, the host-side programs import nothing of ddplaunch but each other, and
no module outside backends/ and the spec asks which backend it drives (what a backend can do is
its registration's)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ddplaunch"


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ddplaunch")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddplaunch"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            known = {s for s in subs if (PKG.parent / (s.replace(".", "/") + ".py")).exists()
                     or (PKG.parent / s.replace(".", "/") / "__init__.py").exists()}
            # `from pkg import submodule` needs the submodule, not what pkg/__init__ imports
            found |= known if known == subs else known | {node.module}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = {d for d in _imports(path) if d in modules and d != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as a path (empty when there is none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def test_modules_and_functions_stay_small():
    too_long = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PKG)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}(): {length} lines")
    assert too_long == []


#: ddplaunch's packages (and top-level modules), lowest first: each imports only those before it
#: in this list and itself. The flow reads bottom-up: spec -> plan -> (record, output) ->
#: backends -> diagnose -> report -> run -> supervise -> the command line and the API.
LAYERS = ["errors", "hostside", "checkpoint", "sim", "spec", "plan", "record", "output", "backends", "diagnose", "report",
          "run", "supervise", "api", "ddplaunch", "cli", "__main__"]
#: Modules at the top of ddplaunch/ (the rest live in the package of their stage).
TOP_LEVEL = {"__init__", "__main__", "api", "checkpoint", "cli", "errors"}


def layer_of(module: str) -> str:
    """`ddplaunch.run.loop` -> `run`; `ddplaunch` (its __init__) -> `ddplaunch`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package from one below it (or of a package the list does not know)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    out = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if mine not in rank or theirs not in rank or rank[theirs] > rank[mine]:
                out.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return out


def test_the_layer_rule_finds_an_upward_import():
    assert layer_violations({"ddplaunch.plan.launch": {"ddplaunch.run.loop"}}) == \
        ["ddplaunch.plan.launch (plan) imports ddplaunch.run.loop (run)"]
    assert layer_violations({"ddplaunch.run.loop": {"ddplaunch.plan.launch", "ddplaunch.run.gates"}}) == []
    assert layer_violations({"ddplaunch.newpkg.x": {"ddplaunch.errors"}}) == \
        ["ddplaunch.newpkg.x (newpkg) imports ddplaunch.errors (errors)"]


def test_each_package_imports_only_the_packages_below_it():
    assert layer_violations(import_graph()) == []


def test_a_handful_of_modules_at_the_top():
    assert {p.stem for p in PKG.glob("*.py")} <= TOP_LEVEL


#: What people read — a host state's words, an outcome's detail, a check's `seen`, an error's
#: message, a summary — is output: code decides from values, never from these texts.
DISPLAY_ATTRS = {"text", "detail", "why", "error", "summary", "describe", "where", "seen", "fix", "message", "cause"}
_SEARCHES = {"split", "rsplit", "startswith", "endswith", "find", "rfind", "index", "partition", "rpartition", "count"}
_REGEX = {"search", "match", "fullmatch", "findall", "finditer", "split"}


def _display(node: ast.AST) -> str | None:
    """`x.detail` or `x.describe()`: the display attribute `node` reads, if it reads one."""
    if isinstance(node, ast.Attribute) and node.attr in DISPLAY_ATTRS:
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DISPLAY_ATTRS:
        return node.func.attr + "()"
    return None


def display_parsed(source: str) -> list[str]:
    """Every place `source` searches or splits display text: `.detail.split(...)`, `"x" in o.why`,
    `re.search(pattern, e.text)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            what = _display(node.func.value)
            if what and node.func.attr in _SEARCHES:
                found.append(f"{node.lineno}: .{what}.{node.func.attr}()")
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.func.attr in _REGEX:
                found += [f"{node.lineno}: re.{node.func.attr}(..., .{w})" for w in map(_display, node.args[1:2]) if w]
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            found += [f"{node.lineno}: ... in .{w}" for w in map(_display, node.comparators) if w]
    return found


def test_the_display_text_finder_finds_text_parsed_back():
    assert display_parsed('if "ended by a signal" in o.detail: pass') == ["1: ... in .detail"]
    assert display_parsed("word = event.text.split(' (')[0]") == ["1: .text.split()"]
    assert display_parsed("m = re.search(r'exit', outcome.describe())") == ["1: re.search(..., .describe())"]
    assert display_parsed("if o.signalled and o.state == NodeState.FAILED: pass") == []


def test_no_display_text_is_parsed_back():
    """Decisions come from values (a state, an exit code, a flag), not from words written for people
    (the host programs on the hosts and the sim's test bed aside)."""
    found = [f"{p.relative_to(PKG)}:{where}" for p in PKG.rglob("*.py") if not {"hostside", "sim"} & set(p.parts)
             for where in display_parsed(p.read_text())]
    assert found == []


def test_events_hold_values_and_text_only_to_be_shown_as_it_is():
    """Every event field is a value — a number, a flag, an enum, a typed result — or one of the few
    texts that are names (hosts, the backend) or are shown exactly as they are (a screen line, a
    request as executed, a refusal's reason): no state travels as words."""
    import dataclasses
    import typing

    from ddplaunch.record.events import KINDS

    names = {"run_id", "backend", "host", "hosts", "supervisor_host", "master", "gate", "job_id", "output_path"}
    shown_as_is = {("shown", "text"), ("requested", "text"), ("not-recovered", "why"), ("spare-dropped", "why"),
                   ("run-ended", "error")}
    texts = []
    for kind, cls in KINDS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (str, list[str], typing.Optional[str]) and f.name not in names \
                    and (kind, f.name) not in shown_as_is:
                texts.append(f"{kind}.{f.name}")
    assert texts == []


def test_records_and_planning_import_no_backend():
    graph = import_graph()
    for name in graph:
        if layer_of(name) in ("spec", "plan", "record"):
            assert not {d for d in graph[name] if d.startswith("ddplaunch.backends")}, name


def test_hostside_programs_import_only_each_other():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("ddplaunch.hostside."):
            assert all(d.startswith("ddplaunch.hostside") for d in deps), (name, deps)


def test_no_backend_switch_outside_backends_and_the_validator():
    pattern = re.compile(r"""backend\s*(==|!=|in)\s*[("']+(local|ssh|slurm)""")
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if pattern.search(p.read_text()) and "backends" not in p.parts and "sim" not in p.parts]
    assert offenders == []


def test_the_command_line_does_not_import_torch():
    """`ddplaunch validate` refuses a bad spec in a fraction of a second: the CLI's imports hold no
    torch (it costs ~1.2 CPU-s; the checkpoint tier's package once pulled it in through `sim`)."""
    import subprocess
    import sys

    probe = "import sys, ddplaunch.cli, ddplaunch.api; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], check=True)
    assert out.stdout.strip() == "[]", out.stdout
