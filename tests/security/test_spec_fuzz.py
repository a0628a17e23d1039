"""Fuzzing load_spec: any bytes under any path end in a ClusterSpec or one SpecError line.

Hypothesis builds documents from the spec's real keys with hostile scalars (huge integers,
control characters, NUL, tabs, YAML's coercible words, explicit tags on values that are not what
the tag says, empty values, hostlist bombs), anchors and alias bombs (also large scalars referenced
many times), deep nesting and duplicate keys, then mutates their bytes (non-UTF-8, truncation) and
throws odd path strings at the loader. Every call must return a spec or raise SpecError with one line under 4096 bytes,
within 1 s of CPU time (CPU, not wall clock: the CI machine is shared). Derandomized, so CI runs
the same 2,100 examples every time; `-s` prints the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ddplaunch.errors import SpecError
from ddplaunch.spec.load import load_spec
from ddplaunch.spec.model import ClusterSpec
from tests.timing import CLI_REFUSAL_UNITS, SPEC_LOAD_UNITS, cpu_time, cpu_within

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"documents": 0, "specs": 0, "errors": 0, "slowest_cpu_s": 0.0, "slowest_wall_s": 0.0,
           "largest_output_bytes": 0, "slowest_case": ""}


def _fuzz_settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def check_load(path: typing.Union[str, Path]) -> str:
    """load_spec(path) under the contract; returns what `validate` would print (or the error)."""
    wall = time.perf_counter()
    with cpu_time() as took:
        try:
            spec: typing.Optional[ClusterSpec] = load_spec(path)
        except SpecError as err:
            spec, out = None, str(err)
    cpu, wall = took.seconds, time.perf_counter() - wall
    if spec is None:
        assert "\n" not in out and "\r" not in out, out[:300]
        assert len(out.encode("utf-8", "backslashreplace")) < 4096
        FIGURES["errors"] += 1
    else:
        assert isinstance(spec, ClusterSpec)
        out = yaml.safe_dump(spec.redacted(), sort_keys=False)
        FIGURES["specs"] += 1
    cpu_within(cpu, SPEC_LOAD_UNITS, f"loading {str(path)[:200]!r}")
    FIGURES["documents"] += 1
    if cpu > FIGURES["slowest_cpu_s"]:
        FIGURES["slowest_cpu_s"], FIGURES["slowest_case"] = cpu, out[:160]
    FIGURES["slowest_wall_s"] = max(FIGURES["slowest_wall_s"], wall)
    FIGURES["largest_output_bytes"] = max(FIGURES["largest_output_bytes"], len(out.encode("utf-8", "replace")))
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "jobs").mkdir()
    (d / "jobs" / "toy_ddp.py").write_text("print('hi')\n")
    yield d
    print("\nspec fuzz figures: " + json.dumps(FIGURES))


# --------------------------------------------------------------------------- strategies


def _keys(model: type[BaseModel]) -> list[str]:
    return [k for k in model.model_fields if k != "base_dir"]


def _sections() -> dict[str, list[str]]:
    out = {}
    for name, field in ClusterSpec.model_fields.items():
        ann = field.annotation
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is list else ann
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            out[name] = _keys(inner)
    out["env"] = ["A", "HF_TOKEN", "X1", "1BAD", "value", "from_env", "secret", "PASSWORD"]
    return out


TOP_KEYS = _keys(ClusterSpec)
SECTION_KEYS = _sections()
ALL_KEYS = sorted({k for ks in SECTION_KEYS.values() for k in ks} | set(TOP_KEYS) | {"<<", "base_dir", "hosts"})

WORDS = ["", "~", "null", "yes", "no", "on", "off", "true", "010", "0x1F", "0o17", "0b101", "12:30",
         "1:2:3", "1e3", ".inf", "-.inf", ".nan", "1_000", "-", "--", "---", "...", "?", "&", "*", "!",
         "|", ">", "%", "@", "`", "<<", "=", "2024-13-45", "2024-01-01", "localhost", "auto", "gloo",
         "nccl", "slurm", "ssh", "local", "4K", "1M", "16M", "--exclusive", "--mem=0", "~nosuchuser/x",
         "~", "a" * 300, "/" * 300, "jobs/toy_ddp.py", "10.0.0.1", "gpu1", "bob", "01:00:00", "1-12",
         "UNLIMITED", "-oProxyCommand=x", "a b", "a\tb", "{from_env: HOME}", "<secret>", "[key]", "$HOME",
         "`id`", "$(id)", "'", '"', "\\", "\u2028", "\x85", "\ufeff", "é", "日本",
         "n[1-100000000]", "n[1-65536]", "a[1-300]b[1-300]", "gpu[1-3", "gpu[3-1]", "gpu[1-a]", "x[]", "[1-2]"]
#: Explicit tags, each also on values that are not what it says (`!!int "-"`, `!!bool maybe`).
TAGS = ["!!int", "!!bool", "!!float", "!!null", "!!str", "!!binary", "!!timestamp", "!!set", "!!seq", "!!map",
        "!local", "!<tag:yaml.org,2002:int>"]
HOSTILE_CHARS = st.characters(codec=None, exclude_categories=("Cs",)) | st.sampled_from(
    ["\x00", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\u2028", "\ufffe", ":", "#", "&", "*", "!", "-", " "])
CLEAN_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=0x24F, exclude_categories=("Cc",)), max_size=24)
TEXT = st.one_of(CLEAN_TEXT, CLEAN_TEXT, CLEAN_TEXT, CLEAN_TEXT, st.text(HOSTILE_CHARS, max_size=24))
HUGE_INT = st.one_of(st.integers().map(str), st.builds(  # up to 5,000 digits (str(int) stops at 4,300)
    lambda sign, digit, n, tail: sign + digit * n + tail, st.sampled_from(["", "-", "+"]),
    st.sampled_from("123456789"), st.integers(1, 5000), st.sampled_from(["", "_0", ".5", "e9", ":30"])))
FLOATS = st.floats(allow_nan=True, allow_infinity=True).map(repr)
RAW = st.one_of(st.sampled_from(WORDS), TEXT, HUGE_INT, FLOATS, st.integers(0, 70000).map(str))


@st.composite
def scalar(draw: st.DrawFn) -> str:
    """A scalar rendered plain (raw, may break the syntax), single- or double-quoted."""
    text = draw(RAW)
    style = draw(st.sampled_from(["plain", "plain", "single", "double", "block", "tagged"]))
    if style == "tagged":
        return f"{draw(st.sampled_from(TAGS))} {json.dumps(text)}"
    if style == "single":
        return "'" + text.replace("'", "''") + "'"
    if style == "double":
        return json.dumps(text)  # \u0000, \n ... escapes
    if style == "block":
        return "|\n  " + text.replace("\n", "\n  ")
    return text


def flow(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    keys = st.sampled_from(ALL_KEYS) | scalar()
    return st.one_of(
        st.lists(children, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(keys, children), max_size=4).map(
            lambda kvs: "{" + ", ".join(f"{k}: {v}" for k, v in kvs) + "}"),
    )


VALUE = st.recursive(scalar(), flow, max_leaves=8)


@st.composite
def anchored(draw: st.DrawFn) -> tuple[str, str]:
    """(definition lines, alias) of an alias bomb or a plain anchor, to hang under a real key."""
    width, depth = draw(st.integers(1, 12)), draw(st.integers(1, 10))
    kind = draw(st.sampled_from(["seq", "map", "merge", "recursive", "plain", "large"]))
    if kind == "recursive":
        return "x0: &a0 [1, *a0]\n", "*a0"
    if kind == "large":  # a large scalar referenced many times: few values, many bytes
        size, refs = draw(st.integers(1, 20_000)), draw(st.integers(1, 3_000))
        return (f"setup: [&a0 {json.dumps('S' * size)}]\nx1: &a1 [" + ", ".join(["*a0"] * refs) + "]\n",
                draw(st.sampled_from(["*a1", "*a0"])))
    if kind == "plain":
        return f"setup: &a0 {draw(VALUE)}\n", "*a0"
    lines = ["x0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, depth):
        if kind == "seq":
            body = "[" + ", ".join([f"*a{i - 1}"] * width) + "]"
        elif kind == "map":
            body = "{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}"
        else:
            body = "{<<: [" + ", ".join([f"*a{i - 1}"] * width) + "], k: 1}" if i > 1 else \
                "{k: [" + ", ".join([f"*a{i - 1}"] * width) + "]}"
        lines.append(f"x{i}: &a{i} {body}")
    return "\n".join(lines) + "\n", f"*a{depth - 1}"


@st.composite
def document(draw: st.DrawFn) -> str:
    """A spec-shaped document: real keys (repeats allowed), hostile values, sometimes a bomb."""
    parts = []
    prelude, alias = draw(anchored()) if draw(st.booleans()) else ("", None)
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(TOP_KEYS + ["hosts", "env", "slurm", "ssh"]) | st.sampled_from(ALL_KEYS))
        if key in SECTION_KEYS and draw(st.booleans()):
            sub = draw(st.lists(st.tuples(st.sampled_from(SECTION_KEYS[key]), VALUE), max_size=4))
            if key == "hosts":
                parts.append("hosts:\n" + "".join(f"  - {{{k}: {v}}}\n" for k, v in sub))
            else:
                parts.append(f"{key}:\n" + "".join(f"  {k}: {v}\n" for k, v in sub))
        elif alias and draw(st.booleans()):
            parts.append(f"{key}: {alias}\n")
        else:
            parts.append(f"{key}: {draw(VALUE)}\n")
    nest = draw(st.sampled_from([0, 0, 0, 5, 33, 200, 3000]))
    if nest:
        if draw(st.booleans()):
            parts.append("job: {args: " + "[" * nest + "]" * nest + "}\n")
        else:
            parts.append("env:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(min(nest, 300))))
    return prelude + "".join(parts)


def _write(workdir: Path, data: bytes) -> Path:
    path = workdir / "c.yaml"
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- properties


@_fuzz_settings(1200)
@given(doc=document())
def test_spec_shaped_documents(workdir: Path, doc: str) -> None:
    check_load(_write(workdir, doc.encode("utf-8", "surrogatepass")))


MUTATION = st.tuples(st.integers(0, 10 ** 6), st.binary(max_size=6),
                     st.sampled_from(["insert", "replace", "truncate"]))


@_fuzz_settings(600)
@given(base=st.sampled_from(["reference", "document"]), doc=document(), mutations=st.lists(MUTATION, max_size=4))
def test_mutated_bytes(workdir: Path, base: str, doc: str, mutations: list) -> None:
    """Non-UTF-8 bytes, NUL and truncation anywhere in the reference cluster.yaml or a document."""
    data = bytearray((ROOT / "cluster.yaml").read_bytes() if base == "reference" else doc.encode("utf-8", "surrogatepass"))
    for pos, chunk, op in mutations:
        pos %= len(data) + 1
        if op == "insert":
            data[pos:pos] = chunk
        elif op == "replace":
            data[pos:pos + len(chunk)] = chunk
        else:
            del data[pos:]
    check_load(_write(workdir, bytes(data)))


PATHS = st.one_of(
    st.text(st.characters(codec=None), max_size=40),
    st.sampled_from(["", "~nosuchuser/c.yaml", "~nosuchuser", "/dev/null", "/dev/zero", "/", ".", "/proc/self/mem",
                     "a" * 300, "d/" * 2100 + "c.yaml", "c.yaml\0x", "\ud800.yaml", "-", "/etc/shadow"]),
)


@_fuzz_settings(300)
@given(path=PATHS)
def test_any_path_string(workdir: Path, path: str) -> None:
    check_load(path)


# --------------------------------------------------------------------------- the command line


CLI_CASES = {
    "nul.yaml": b"name: x\nhosts: [a\x00]\n",
    "latin1.yaml": "name: caf\u00e9\n".encode("latin-1"),
    "bomb.yaml": b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
                 b"b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
                 b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\njob: {args: *e}\n",
    "bigint.yaml": b"rdzv_timeout: " + b"9" * 4301 + b"\n",
    "deep.yaml": b"job: {args: " + b"[" * 5000 + b"]" * 5000 + b"}\n",
    "dupe.yaml": b"name: a\nbackend: local\nname: b\n",
    # the classes of the second audit: explicit tags, empty scalars, amplification, hostlist bombs
    "tag-int.yaml": b'rdzv_timeout: !!int "-"\n',
    "tag-hex.yaml": b'master: {port: !!int "0x"}\n',
    "tag-bool.yaml": b"healthcheck: {enabled: !!bool maybe}\n",
    "tag-bool-empty.yaml": b"healthcheck: {enabled: !!bool ''}\n",
    "empty-size.yaml": b"healthcheck: {sizes: ['']}\n",
    "amplified.yaml": (b'setup: [&s "echo ' + b"S" * 10_000 + b'"]\njob: {args: [' + b", ".join([b"*s"] * 9000)
                       + b"]}\n"),
    "hostlist-bomb.yaml": b'backend: ssh\nhosts: ["n[1-100000000]"]\n',
    "hostlist-product.yaml": b'backend: ssh\nhosts: ["a[1-1000]b[1-1000]"]\n',
    "python-dash.yaml": b'python: "-a"\n',
    "ddplaunch-env.yaml": b"env: {DDPLAUNCH_RUN_ID: someone-elses-run}\n",
}


def _address_space_4g() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_validate_exit_2_one_line_no_traceback(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(CLI_CASES[name])
    with cpu_time(children=True) as took:  # the interpreter's start included: ~0.4 CPU-s
        proc = subprocess.run([sys.executable, "-m", "ddplaunch", "validate", str(path)], capture_output=True,
                              text=True, errors="replace", timeout=60, cwd=ROOT, preexec_fn=_address_space_4g,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddplaunch: error: {path}:"), proc.stderr[-2000:]
    assert len(proc.stderr.encode()) < 4096
    cpu_within(took.seconds, CLI_REFUSAL_UNITS, f"`ddplaunch validate {name}`")
