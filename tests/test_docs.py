"""Docs that stay true: the reference cluster.yaml names every key of the spec model, and loads;
docs/architecture.md names only modules, packages and classes that are where it says, describes
every package in the order of the layers, and says only what the code does (but KNOWN_FALSE)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from ddplaunch.spec.model import ClusterSpec

from ddplaunch.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        out.append(prefix + name)
        for arg in [field.annotation, *typing.get_args(field.annotation)]:
            for inner in [arg, *typing.get_args(arg)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner.__name__ != "EnvVar":
                    out += _keys(inner, prefix + name + ".")
    return out


def test_cluster_yaml_mentions_every_key_of_the_spec():
    text = (ROOT / "cluster.yaml").read_text()
    missing = [k for k in _keys(ClusterSpec)
               if not re.search(rf"(^|\W){re.escape(k.split('.')[-1])}\s*:", text, re.M)]
    assert missing == [], f"cluster.yaml does not document: {missing}"
    assert load_spec(ROOT / "cluster.yaml").backend == "local"


def test_key_walk_sees_nested_sections():
    keys = _keys(ClusterSpec)
    assert "healthcheck.pair_size" in keys and "slurm.signal_seconds" in keys and "hosts.python" in keys


def test_every_troubleshooting_example_is_checked_by_the_test_it_names():
    from tests.doc_examples import blocks

    found = blocks()
    assert len(found) >= 9, sorted(found)  # one per section of docs/troubleshooting.md
    for name, mark in found.items():
        path, func = mark["test"].split("::")
        source = (ROOT / path).read_text()
        start = source.index(f"def {func.split('[')[0]}(")
        end = source.find("\ndef ", start + 1)
        assert f'check_doc_example("{name}"' in source[start:end if end > 0 else None], (name, mark["test"])


def test_doc_example_lines_compare_shape_not_values():
    from tests.doc_examples import normalize

    same = ("dlw2 (10.213.21.12): reach: no answer within ssh.connect_timeout=5.0s in /tmp/x/runs/doc-1/",
            "dlt7 (10.213.7.17): reach: no answer within ssh.connect_timeout=15.0s in /root/.d/runs/fm-2/")
    assert normalize(same[0], ["dlw2"]) == normalize(same[1], ["dlt7"])
    assert normalize("timeout=5s", []) != normalize("timeout=5.0s", [])  # the figure's format is checked
    assert normalize("run fm-dead-ssh: FAILED (exit 1)", []) == normalize("run doc-x: FAILED (exit 1)", [])
    assert normalize("dlw1 (node 0): ok", ["dlw1"]) != normalize("dlw1 (node 0): failed", ["dlw1"])


def test_readme_plan_line_is_what_the_dry_run_prints(tmp_path):
    """README's example of `up cluster.yaml --dry-run` (run id demo) is the real line, with this
    checkout's path and interpreter written as /path/to/ddplaunch/.venv/bin/python."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ddplaunch", "up", "cluster.yaml", "--dry-run", "--run-id", "demo"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env=dict(os.environ, DDPLAUNCH_HOME=str(tmp_path))).stdout
    (real,) = [line for line in out.splitlines() if line.startswith("cd ")]
    (shown,) = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.strip().startswith("cd /path/to/ddplaunch")]

    def same(line: str) -> str:
        return re.sub(r"\S*/bin/python[\d.]*", "PYTHON", line.replace(str(ROOT), "/path/to/ddplaunch"))
    assert same(shown) == same(real)


# --------------------------------------------------------------------------- docs/architecture.md

#: What docs/architecture.md says today that the code does not do, while issue #51 changes the
#: code (or the doc) to match: the memories beside the event log, a "pure" package that starts a
#: thread. Asserted to be exactly what the checks find, so an entry that becomes true fails the
#: test until it is removed here: empty it as the work lands, and keep it empty.
KNOWN_FALSE: set[str] = set()


def test_the_architecture_doc_names_only_modules_that_exist():
    from tests.archdoc import doc, missing_paths

    assert missing_paths(doc()) == []


def test_the_architecture_doc_places_each_class_where_it_is_defined():
    from tests.archdoc import doc, misplaced, unknown_classes

    assert misplaced(doc()) + unknown_classes(doc()) == []


def test_the_package_table_describes_every_package_in_the_order_of_the_layers():
    from tests.archdoc import doc, table_order, undescribed
    from tests.test_architecture import LAYERS

    assert undescribed(doc()) == []
    assert table_order(doc()) == [name for name in LAYERS if name not in ("ddplaunch", "__main__")]


def test_what_the_architecture_doc_says_is_true_but_the_known_false():
    """The table's "pure" packages start no thread or process; every file a run's directory holds
    is named in "The run's memory"; `who.py` is the one reader of the `[host:rank]` prefix."""
    from tests.archdoc import doc, impure_in_pure_rows, prefix_readers, unnamed_run_files

    found = impure_in_pure_rows(doc()) + unnamed_run_files(doc()) + prefix_readers()
    assert sorted(set(found) - KNOWN_FALSE) == [], "the doc is not true of the code"
    assert sorted(KNOWN_FALSE - set(found)) == [], "true now: remove from KNOWN_FALSE"


def test_the_doc_reader_finds_what_is_false():
    """Each check of the architecture doc fails on a doc that is wrong, read through its prose."""
    from tests.archdoc import Doc, doc, misplaced, missing_paths, undescribed, unknown_classes

    text = ("| package | owns | pure? |\n|---|---|---|\n"
            "| `record/` | a stage's end (`results.py`: `NodeOutcome`, `RunView`), `gone.py` | yes |\n\n"
            "The fold (`record/view.py`: `RunView`) of\n`record/events.py` (and `StageResult`); `run/nope.py`,\n"
            "`run/gates.Missing`, `Local(pid, host)`, `Nowhere`; `view.json`, `up --detach`, `supervisor.host`.\n")
    wrong = Doc(text)
    assert missing_paths(wrong) == ["line 3: `gone.py`: no ddplaunch/record/gone.py",
                                    "line 6: `run/nope.py`: no ddplaunch/run/nope.py"]
    assert misplaced(wrong) == ["line 3: RunView is not defined in ddplaunch/record/results.py",
                                "line 6: StageResult is not defined in ddplaunch/record/events.py",
                                "line 7: Missing is not defined in ddplaunch/run/gates"]
    assert unknown_classes(wrong) == ["line 7: Local does not take (pid, host)",
                                      "line 7: Nowhere is defined nowhere in ddplaunch/"]
    assert "package ddplaunch/run/ is in no row of the package table" in undescribed(wrong)
    assert "package ddplaunch/record/ is in no row of the package table" not in undescribed(wrong)
    assert len(undescribed(doc())) < len(undescribed(wrong))


def test_the_doc_reader_finds_what_is_not_pure_and_who_reads_a_prefix():
    import ast

    from tests.archdoc import impure, opens_a_prefix

    def opens(source: str) -> bool:
        return opens_a_prefix(ast.parse(source, mode="eval").body)
    assert opens('f"[{host}:"') and opens('"] "') and not opens('f"{host}:"') and not opens('"["')
    assert impure("import threading\nfrom concurrent.futures import wait\ntime.sleep(1)") == \
        ["calls time.sleep", "imports concurrent.futures", "imports threading"]
    assert impure("import time\nfrom pathlib import Path\ntime.monotonic()") == []
