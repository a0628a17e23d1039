"""The shape of the code: no import circles in ddplaunch/ (lazy imports inside functions and
imports for type checking count too), no module over 500 lines and no function over 60, run
records import no backend, the host-side
programs import nothing of ddplaunch but each other, and no module outside backends/ and the
spec asks which backend it drives (what a backend can do is its registration's)."""

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


def test_records_and_planning_import_no_backend():
    graph = import_graph()
    for name in ("ddplaunch.runs", "ddplaunch.plan", "ddplaunch.spec", "ddplaunch.results"):
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
