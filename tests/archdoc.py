"""docs/architecture.md read as claims about the code: the modules and packages it names, the
classes it places in a module, its package table (order, rows, "pure?"), and the files it says a
run's directory holds. Each check (`missing_paths`, `misplaced`, `unknown_classes`, `undescribed`,
`impure_in_pure_rows`, `unnamed_run_files`, `prefix_readers`) returns what the doc says that the
code does not do, one line each (empty: the doc is true); tests/test_docs.py asserts them.

How the doc's prose is read:
- a backticked path (`record/view.py`, `hostside/`, `run/gates.InStagePreflight`,
  `record/view.RunView.of(events)`) is relative to ddplaunch/; a bare one (`entry.py`, `ssh/`) in a
  row of the package table is relative to that row's package, elsewhere to ddplaunch/ itself;
  paths in the code block (`spec/load`, `record/view.RunView`) count too;
- a name after a path's dot (`run/gates.InStagePreflight`) lives in that module;
- so do the names in backticks that follow a path inside the same parentheses, or inside the
  parentheses right after it, up to the next path: "(`results.py`: `NodeOutcome`, `StageResult`)",
  "`backends/contract.Launcher` (and `Scheduler` ...)";
- every other backticked CapWord (`RunView`, `Local(pid, start, host)`) is a class or alias of
  ddplaunch somewhere, made with the arguments the doc gives it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ddplaunch"
DOC = ROOT / "docs" / "architecture.md"

_SPAN = re.compile(r"`([^`\n]+)`")
#: `record/view.RunView.of(events)` -> path `record/view`, attributes `.RunView.of`.
_PATH = re.compile(r"^(?P<path>(?:[a-z_][a-z0-9_]*/)*[a-z_][a-z0-9_]*(?:\.py|/)?)(?P<attrs>(?:\.[A-Za-z_]\w*)*)"
                   r"(?:\(.*\))?$")
_NAME = re.compile(r"^(?P<name>[A-Za-z_]\w*)(?:\((?P<args>.*)\))?$")
_FENCE_PATH = re.compile(r"(?<![\w./-])((?:[a-z_]+/)+(?:[a-z_]+(?:\.[A-Za-z_]\w*)*)?)")


@dataclass(frozen=True)
class Named:
    """A module or package the doc names: `rel` relative to the repository ("ddplaunch/run/gates.py",
    "ddplaunch/hostside/", "ddplaunch/run/loop" when the doc leaves the suffix out) and the names
    after its dot (`run/gates.InStagePreflight`: "InStagePreflight")."""

    line: int
    text: str
    rel: str
    attrs: tuple[str, ...]


@dataclass(frozen=True)
class Placed:
    """A name the doc places in a module (or a package)."""

    line: int
    name: str
    where: str


@dataclass(frozen=True)
class Row:
    """A row of the package table: its packages or top modules (first column) and its "pure?"."""

    line: int
    names: tuple[str, ...]
    pure: str


def resolve(text: str, base: str, line: int = 0) -> Optional[Named]:
    """The path `text` names, relative to `base` ("ddplaunch/" or a package of it) when it has no
    slash; None when it names no module (`view.json`, `supervisor.host`, `up --detach`)."""
    m = _PATH.match(text)
    if m is None:
        return None
    path, attrs = m.group("path"), tuple(a for a in m.group("attrs").split(".") if a)
    if "/" not in path.rstrip("/") and not path.endswith((".py", "/")):
        return None
    if path.startswith("tests/"):
        return Named(line, text, path, attrs)
    return Named(line, text, (base if "/" not in path.rstrip("/") else "ddplaunch/") + path, attrs)


def exists(rel: str) -> bool:
    """A module (`x.py`, or `x` standing for it) or a package (`x/`, or `x`) of the repository."""
    if rel.endswith(".py"):
        return (ROOT / rel).is_file()
    if rel.endswith("/"):
        return (ROOT / rel / "__init__.py").is_file()
    return (ROOT / f"{rel}.py").is_file() or (ROOT / rel / "__init__.py").is_file()


def _module_files(rel: str) -> list[Path]:
    if rel.endswith(".py"):
        return [ROOT / rel]
    if (ROOT / f"{rel.rstrip('/')}.py").is_file():
        return [ROOT / f"{rel.rstrip('/')}.py"]
    return sorted((ROOT / rel).rglob("*.py"))


@cache
def _defined(path: Path) -> dict[str, ast.AST]:
    """The names a module defines at its top (classes, functions, assignments)."""
    out: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def defines(rel: str, attrs: tuple[str, ...]) -> bool:
    """Whether the module (or any module of the package) `rel` defines `attrs[0]`, and that class
    `attrs[1]` (a method or a field)."""
    for path in _module_files(rel):
        node = _defined(path).get(attrs[0])
        if node is None:
            continue
        if len(attrs) == 1:
            return True
        methods = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))] \
            if isinstance(node, ast.ClassDef) else []
        if isinstance(node, ast.ClassDef) and attrs[1] in _fields(node) + methods:
            return True
    return False


def _fields(node: ast.ClassDef) -> list[str]:
    """A class's annotated fields, in order (not its ClassVars)."""
    return [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name) and "ClassVar" not in ast.unparse(item.annotation)]


class Doc:
    """docs/architecture.md (or any text in its shape), read once."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.rows = list(self._rows())

    def _rows(self) -> Iterator[Row]:
        header = next((i for i, ln in enumerate(self.lines) if ln.startswith("| package |")), None)
        if header is None:
            return
        for i in range(header + 2, len(self.lines)):
            if not self.lines[i].startswith("|"):
                return
            cells = [c.strip() for c in self.lines[i].strip().strip("|").split("|")]
            yield Row(i + 1, tuple(_SPAN.findall(cells[0])), cells[-1])

    @staticmethod
    def _base(row: Row) -> str:
        """Where a bare name in `row` lives: the row's one package, else the top of ddplaunch/."""
        if len(row.names) == 1 and row.names[0].endswith("/"):
            return f"ddplaunch/{row.names[0]}"
        return "ddplaunch/"

    def units(self) -> Iterator[tuple[int, str, str]]:
        """(first line, text, base) of each table cell, each paragraph or list item of prose and
        each line of the code block (its paths only, those of the table's packages)."""
        rows = {r.line: r for r in self.rows}
        tops = {n.rstrip("/") for r in self.rows for n in r.names}
        fence, start, para = False, 0, list[str]()
        for i, text in enumerate([*self.lines, ""], 1):
            if para and (not text.strip() or text.startswith(("#", "- ", "|", "```"))):
                yield start, "\n".join(para), "ddplaunch/"
                para = []
            if text.startswith("```"):
                fence = not fence
            elif fence:
                found = [p for p in _FENCE_PATH.findall(text) if p.split("/")[0] in tops]
                yield i, " ".join(f"`{p}`" for p in found), "ddplaunch/"
            elif i in rows:
                first, *cells = text.strip().strip("|").split("|")
                yield i, first, "ddplaunch/"
                yield from ((i, cell, self._base(rows[i])) for cell in cells)
            elif text.strip() and not text.startswith("#"):
                start, para = (i, [text]) if not para else (start, [*para, text])

    def spans(self) -> Iterator[tuple[int, str, str]]:
        """(line, text, base) of every backticked span."""
        for line, text, base in self.units():
            for m in _SPAN.finditer(text):
                yield line + text.count("\n", 0, m.start()), m.group(1), base

    def paths(self) -> list[Named]:
        """Every module or package path the doc names."""
        return [p for line, span, base in self.spans() if (p := resolve(span, base, line)) is not None]

    def placed(self) -> list[Placed]:
        """Every name the doc places in a module: after its dot, or beside it in parentheses."""
        out = [Placed(p.line, ".".join(p.attrs), p.rel) for p in self.paths() if p.attrs]
        for line, text, base in self.units():
            out += _beside(line, text, base)
        return out

    def classes(self) -> list[tuple[int, str, Optional[str]]]:
        """Every backticked CapWord (not an ALL_CAPS constant) and the arguments the doc gives it
        (`Local(pid, start, host)`: "pid, start, host"; None when it gives none)."""
        return [(line, m.group("name"), m.group("args")) for line, span, _ in self.spans()
                if (m := _NAME.match(span)) and m.group("name")[0].isupper() and not m.group("name").isupper()]

    def section(self, title: str) -> str:
        """The text under `## title`, up to the next heading of that level."""
        start = self.lines.index(f"## {title}")
        end = next((i for i in range(start + 1, len(self.lines)) if self.lines[i].startswith("## ")),
                   len(self.lines))
        return "\n".join(self.lines[start + 1:end])


def _beside(line: int, text: str, base: str) -> list[Placed]:
    """The names placed beside a path in one table cell or paragraph: from a path inside
    parentheses to their end, or in the parentheses right after a path; up to the next path."""
    spans = list(_SPAN.finditer(text))
    plain = _SPAN.sub(lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", text)  # parentheses of prose only
    out = []
    for k, span in enumerate(spans):
        path = resolve(span.group(1), base, line)
        if path is None:
            continue
        end = _group_end(plain, span.start(), span.end())
        for later in spans[k + 1:]:
            if later.start() > end or resolve(later.group(1), base) is not None:
                break
            m = _NAME.match(later.group(1))
            if m:
                out.append(Placed(line + text.count("\n", 0, later.start()), m.group("name"), path.rel))
    return out


def _group_end(plain: str, start: int, end: int) -> int:
    """Where the parentheses around `plain[start:end]` close, or those that open right after it;
    -1 when there are none."""
    depth = 0
    for i in range(start - 1, -1, -1):  # open around it?
        depth += {")": 1, "(": -1}.get(plain[i], 0)
        if depth < 0:
            return _closing(plain, end, 1)
    after = plain[end:].lstrip(" ")
    return _closing(plain, len(plain) - len(after) + 1, 1) if after.startswith("(") else -1


def _closing(plain: str, at: int, depth: int) -> int:
    for i in range(at, len(plain)):
        depth += {"(": 1, ")": -1}.get(plain[i], 0)
        if depth == 0:
            return i
    return len(plain)


def doc() -> Doc:
    """docs/architecture.md as it is."""
    return Doc(DOC.read_text())


def missing_paths(d: Doc) -> list[str]:
    """Modules and packages the doc names that do not exist."""
    return sorted({f"line {p.line}: `{p.text}`: no {p.rel}" for p in d.paths() if not exists(p.rel)})


def misplaced(d: Doc) -> list[str]:
    """Names the doc places in a module that it does not define."""
    return sorted({f"line {p.line}: {p.name} is not defined in {p.where}" for p in d.placed()
                   if exists(p.where) and not defines(p.where, tuple(p.name.split(".")))})


@cache
def _all_classes() -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for path in PKG.rglob("*.py"):
        for name, node in _defined(path).items():
            out.setdefault(name, []).append(node)
    return out


def unknown_classes(d: Doc) -> list[str]:
    """CapWords the doc names that ddplaunch does not define, or not with the arguments it gives."""
    out = []
    for line, name, args in d.classes():
        nodes = _all_classes().get(name, [])
        if not nodes:
            out.append(f"line {line}: {name} is defined nowhere in ddplaunch/")
        elif args is not None and not any(isinstance(n, ast.ClassDef) and takes(n, args) for n in nodes):
            out.append(f"line {line}: {name} does not take ({args})")
    return sorted(set(out))


def takes(node: ast.ClassDef, args: str) -> bool:
    """Whether a class is made with `args` as the doc writes them: its fields (or its __init__'s
    parameters) first the positional names, and each keyword one of them."""
    words = [a.strip() for a in args.split(",") if a.strip()]
    positional = [w for w in words if "=" not in w]
    keywords = [w.split("=")[0].strip() for w in words if "=" in w]
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    for names in (_fields(node), [a.arg for a in init.args.args[1:]] if init else []):
        if names[:len(positional)] == positional and set(keywords) <= set(names):
            return True
    return False


def packages() -> list[str]:
    """Every package of ddplaunch/ but ddplaunch itself, as "ddplaunch/x/"."""
    return sorted(f"{p.parent.relative_to(ROOT)}/" for p in PKG.rglob("__init__.py") if p.parent != PKG)


def undescribed(d: Doc) -> list[str]:
    """Packages no row of the table names, and top modules the doc never names."""
    rows = {r.line for r in d.rows}
    named = {p.rel for p in d.paths() if p.line in rows}
    named |= {p.rel.rstrip("/") + "/" for p in d.paths() if p.line in rows and not p.rel.endswith(".py")}
    out = [f"package {p} is in no row of the package table" for p in packages() if p not in named]
    everywhere = {p.rel for p in d.paths()}
    out += [f"module ddplaunch/{p.name} is named nowhere" for p in sorted(PKG.glob("*.py"))
            if f"ddplaunch/{p.name}" not in everywhere]
    return out


def table_order(d: Doc) -> list[str]:
    """The table's first column, as LAYERS names them ("errors.py" -> errors, "hostside/" -> hostside)."""
    return [n.removesuffix(".py").rstrip("/") for r in d.rows for n in r.names]


#: What a pure module does not do: start threads or processes, talk on sockets, wait.
IMPURE_IMPORTS = {"threading", "subprocess", "socket", "multiprocessing", "signal", "select", "concurrent"}


def impure(source: str) -> list[str]:
    """What makes a module's source not pure: an impure import, a `time.sleep`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        out += [f"imports {n}" for n in names if n.split(".")[0] in IMPURE_IMPORTS]
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "time.sleep":
            out.append("calls time.sleep")
    return sorted(set(out))


def impure_in_pure_rows(d: Doc) -> list[str]:
    """Modules of the rows whose "pure?" says a plain "yes" that start threads, processes or wait."""
    out = []
    for row in d.rows:
        if row.pure != "yes":
            continue
        for name in row.names:
            rel = f"ddplaunch/{name}"
            for path in _module_files(rel) if exists(rel) else []:
                out += [f"{path.relative_to(PKG)} {why} (the table says {name} is pure)"
                        for why in impure(path.read_text())]
    return sorted(out)


def _str_constants() -> dict[str, str]:
    """Module-level `NAME = "text"` across ddplaunch/ (file names kept in constants)."""
    out = {}
    for path in PKG.rglob("*.py"):
        for name, node in _defined(path).items():
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out[name] = value.value
    return out


def run_dir_files() -> dict[str, str]:
    """The files (and folders) ddplaunch puts in a run's directory, by a fixed name
    (`run_dir / "x.json"`, `record.dir / EVENTS_FILE`), and the module that names each. The
    host programs (they write on the hosts) and the sim are not the launcher's."""
    consts, out = _str_constants(), dict[str, str]()
    for path in PKG.rglob("*.py"):
        if {"hostside", "sim"} & set(path.relative_to(PKG).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            left = ast.unparse(node.left)
            if not left.endswith(("run_dir", ".dir")):
                continue
            right = node.right
            name = right.value if isinstance(right, ast.Constant) and isinstance(right.value, str) else \
                consts.get(right.id) if isinstance(right, ast.Name) else None
            if name is not None:
                out.setdefault(name, str(path.relative_to(PKG)))
    return out


def unnamed_run_files(d: Doc) -> list[str]:
    """The files of a run's directory that "The run's memory" does not name: a memory beside the
    event log, or a rendering of it the doc does not own."""
    said = set(_SPAN.findall(d.section("The run's memory")))
    return sorted(f"{where} writes {name} into a run's directory; the run's memory does not name it"
                  for name, where in run_dir_files().items() if name not in said)


def prefix_readers() -> list[str]:
    """Modules outside output/who.py that read a `[host:rank] ` prefix from text themselves: a
    search for an f-string that opens with `[` and a value, or for `"] "`."""
    searches = {"startswith", "find", "rfind", "index", "split", "rsplit", "partition", "count"}
    out = set()
    for path in PKG.rglob("*.py"):
        rel = str(path.relative_to(PKG))
        if rel == "output/who.py" or {"hostside", "sim"} & set(path.relative_to(PKG).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in searches \
                    and node.args and opens_a_prefix(node.args[0]):
                out.add(f"{rel} reads a [host:rank] prefix itself (`who.py` is the one reader, the doc says)")
    return sorted(out)


def opens_a_prefix(arg: ast.AST) -> bool:
    """`f"[{host}..."` or `"] "`: what a search for a line's prefix looks for."""
    if isinstance(arg, ast.Constant):
        return arg.value == "] "
    return isinstance(arg, ast.JoinedStr) and len(arg.values) >= 2 and isinstance(arg.values[0], ast.Constant) \
        and arg.values[0].value == "[" and isinstance(arg.values[1], ast.FormattedValue)
