"""Docs that stay true: the reference cluster.yaml names every key of the spec model, and loads."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from ddplaunch.spec import ClusterSpec, load_spec

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
