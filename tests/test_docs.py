"""Docs that stay true: the reference cluster.yaml names every key of the spec model, and loads."""

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
