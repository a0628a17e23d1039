"""Hostlists (`hosts:`, `recovery.spares:`) expand exactly as Slurm's `scontrol show hostnames`.

Slurm is the oracle: every valid expression, and a few hundred random ones, are expanded by
`scontrol show hostnames` (offline, with a minimal slurm.conf) and by ddplaunch, and must agree.
Text after the last `[...]` (a suffix) is Slurm's since 23.02.5; with an older scontrol such an
expression is checked as its names without the suffix, each with the suffix appended (which is what
newer Slurm does). Malformed entries, and those Slurm reads surprisingly, are one ValueError naming
the entry; what Slurm does with each is recorded next to it. Bombs are refused before they expand.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import tracemalloc
from pathlib import Path
from typing import Optional, Union

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddplaunch.cli import cli
from ddplaunch.errors import SpecError
from ddplaunch.spec.hostlist import MAX_HOSTS, expand_hostlist, expand_hosts
from ddplaunch.spec.load import load_spec
from tests.timing import cpu_time, cpu_within

SCONTROL = shutil.which("scontrol")
needs_scontrol = pytest.mark.skipif(SCONTROL is None, reason="scontrol (slurm-client) is not installed: it is "
                                                              "the oracle these tests compare hostlists with")


class Slurm:
    """`scontrol show hostnames`, run offline against a minimal slurm.conf."""

    def __init__(self, scontrol: str, conf_dir: Path):
        conf = conf_dir / "slurm.conf"
        conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\nNodeName=localhost\n"
                        "PartitionName=p Nodes=localhost\n")
        self.scontrol, self.env = scontrol, {**os.environ, "SLURM_CONF": str(conf)}
        self.suffixes = self.hostnames("a[1]b") == ["a1b"]  # Slurm 23.02.5 and later

    def hostnames(self, expr: str) -> Optional[list[str]]:
        """The names Slurm prints for `expr`, or None where it refuses it."""
        proc = subprocess.run([self.scontrol, "show", "hostnames", "--", expr], capture_output=True, text=True,
                              env=self.env, timeout=60)
        if proc.returncode != 0 or proc.stderr.strip():
            return None
        return proc.stdout.split("\n")[:-1] if proc.stdout else []

    def expected(self, expr: str) -> Optional[list[str]]:
        """What Slurm 23.02.5+ prints for a well-bracketed `expr`: asked directly, or (older Slurm,
        which refuses suffixes) each item's names without its suffix, the suffix appended."""
        items = [_split_suffix(item) for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", expr)]
        if self.suffixes or not any(suffix for _, suffix in items):
            return self.hostnames(expr)
        out: list[str] = []
        for body, suffix in items:
            names = self.hostnames(body)
            if names is None:
                return None
            out += [name + suffix for name in names]
        return out


def _split_suffix(item: str) -> tuple[str, str]:
    end = item.rfind("]") + 1
    return (item[:end], item[end:]) if end else (item, "")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Slurm:
    if SCONTROL is None:
        pytest.skip("scontrol (slurm-client) is not installed: it is the oracle these tests compare hostlists with")
    oracle = Slurm(SCONTROL, tmp_path_factory.mktemp("slurmconf"))
    assert oracle.hostnames("gpu[1-2]") == ["gpu1", "gpu2"], "scontrol show hostnames does not run offline here"
    return oracle


# --------------------------------------------------------------------------- valid: as Slurm

VALID = [
    "gpu1", "gpu[1-3]", "gpu[01-10]", "rack[1-2]-node[01-02]", "a[1,3-4],b7", "gpu-a[1-2].cluster",
    "gpu-a[1-2]", "gpu.a[1-2]", "x_1[1-2]_y[3]", "a[1-2]b[1-2]c[1-2]", "a[1-2]b[1-2]c[1-2]d[1-2]",
    "a[1-2][3-4]", "[1-2]", "a[0]", "a[007]", "a[9-11]", "a[09-11]", "a[099-101]", "a[09-100]", "a[00-02]",
    "a[2,1]", "a[1-3,2]", "a[1-2],a[1-2]", "a,,b,", ",a", "a9,a010", "a01,a2", "a[8-9],a[010]",
    "a-1,a-2", "n[999999999999999999]", "a0000000000000000000000000001", "n[1-65536]",
    "r[1-2]n[1-2]-gpu[1-2].x,login[01,03]", "a[1-2]b.c[01-02]d-e",
]


def test_documented_examples() -> None:
    assert expand_hostlist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_hostlist("rack[1-2]-node[01-02]") == ["rack1-node01", "rack1-node02", "rack2-node01",
                                                        "rack2-node02"]
    assert expand_hostlist("gpu-a[1-2].cluster") == ["gpu-a1.cluster", "gpu-a2.cluster"]
    assert expand_hostlist("a[1-2]b[1-2]c[1-2]") == ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2",
                                                     "a2b2c1", "a2b2c2"]  # Slurm's own order
    assert expand_hostlist("a[8-10],b[08-10]") == ["a8", "a9", "a10", "b08", "b09", "b10"]


@needs_scontrol
@pytest.mark.parametrize("expr", VALID)
def test_valid_hostlists_expand_as_slurm_does(slurm: Slurm, expr: str) -> None:
    expected = slurm.expected(expr)
    assert expected, f"scontrol refuses {expr!r}"
    assert expand_hostlist(expr) == expected


@st.composite
def _group(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 2))):
        lo, span = draw(st.integers(0, 120)), draw(st.integers(0, 2))
        width = draw(st.sampled_from([0, 0, 1, 2, 3, 4]))  # 0: no padding
        lo_s, hi_s = f"{lo:0{width}d}", f"{lo + span:0{width}d}"
        parts.append(lo_s if draw(st.booleans()) else f"{lo_s}-{hi_s}")
    return "[" + ",".join(parts) + "]"


_TEXT = st.text("abz09-._", max_size=3)


@st.composite
def _item(draw: st.DrawFn) -> str:
    head = draw(st.sampled_from(["a", "gpu", "n-", "rack1-node"]) | st.from_regex(r"[a-z][a-z0-9._-]{0,4}",
                                                                                   fullmatch=True))
    groups = draw(st.integers(0, 3))
    body = head + "".join(draw(_group()) + (draw(_TEXT) if i < groups - 1 else "") for i in range(groups))
    return body + (draw(_TEXT) if groups and draw(st.booleans()) else "")


@needs_scontrol
@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # conftest's autouse one
@given(st.lists(_item(), min_size=1, max_size=3).map(",".join))
def test_random_hostlists_expand_as_slurm_does(slurm: Slurm, expr: str) -> None:
    expected = slurm.expected(expr)
    assert expected is not None, f"scontrol refuses {expr!r}"
    assert expand_hostlist(expr) == expected


# --------------------------------------------------------------------------- refused: named, with what Slurm does

#: entry -> (what the error says, what Slurm does with it: None = refuses, a list = the names it
#: prints, an int = how many it prints, ... = not asked (scontrol takes it for an option); a tuple
#: where Slurm versions differ).
REFUSED: dict[str, tuple[str, object]] = {
    "gpu[1-3": ("'gpu[1-3': '[' at character 4 without a closing ']'", (["gpu]"], None)),  # 22.05; 23.02 refuses
    "gpu[3-1]": ("'gpu[3-1]': range 3-1 runs backwards; write 'gpu[1-3]'", None),
    "a[1-2],b[5-3]": ("range 5-3 runs backwards; write 'a[1-2],b[3-5]'", None),
    "gpu[1-a]": ("'gpu[1-a]': '1-a' in brackets is not a number or a range of numbers", None),
    "gpu[a]": ("'gpu[a]': 'a' in brackets is not a number", None),
    "gpu[-1]": ("'-1' in brackets is not a number", None),
    "gpu[1--2]": ("'1--2' in brackets is not a number", None),
    "gpu[1-2-3]": ("'1-2-3' in brackets is not a number", None),
    "n[0x1-2]": ("'0x1-2' in brackets is not a number", None),
    "gpu[]": ("'gpu[]': empty brackets []", None),
    "gpu[1,]": ("'gpu[1,]': an empty range between commas", None),
    "gpu[,1]": ("an empty range between commas", None),
    "gpu[[1-2]]": ("'gpu[[1-2]]': '[' inside [...] at character 5; brackets do not nest", None),
    "gpu[1-[2]]": ("brackets do not nest", None),
    "gpu[1-2]]": ("'gpu[1-2]]': ']' at character 9 without an opening '['", (None, ["gpu1]", "gpu2]"])),
    "gpu1-2]": ("']' at character 7 without an opening '['", ["gpu1-2]"]),
    "gpu[1-010]": ("'gpu[1-010]': range 1-010 pads its ends differently (Slurm pads every number to the width "
                   "of 1: 1-10); write 'gpu[1-10]' or 'gpu[001-010]'", [f"gpu{i}" for i in range(1, 11)]),
    "a[01-1]": ("range 01-1 pads its ends differently (Slurm pads every number to the width of 01: 01-01); "
                "write 'a[01-01]'", ["a01"]),
    "a[0099-101]": ("write 'a[0099-0101]'", ["a0099", "a0100", "a0101"]),
    "gpu[1-]": ("'gpu[1-]': range '1-' has no end (Slurm reads it as 1); write 'gpu[1]' or 'gpu[1-N]'", ["gpu1"]),
    "n[+1-2]": ("'n[+1-2]': '+' at character 3", ["n01", "n02"]),
    "gpu [1-2]": ("'gpu [1-2]': a space at character 4", ["gpu", "1", "2"]),
    "gpu[1 -2]": ("a space at character 6", ["gpu01", "gpu02"]),
    "a, b": ("a space at character 3", ["a", "b"]),
    "a\tb": ("U+0009 (TAB) at character 2", ["a", "b"]),
    "a@b": ("'@' at character 2", ["a@b"]),
    "a99999999999999999999": ("the number 99999999999999999999 has more than 18 digits",
                              ["a18446744073709551615"]),
    "-a[1-2]": ("'-a[1-2]': a host name cannot start with '-'", ...),
    ",": ("',': names no host", []),
    "n[1-65537]": ("'n[1-65537]': 65537 hosts; at most 65536", None),  # Slurm: too many hosts in range
    "n[1-100000000]": ("'n[1-100000000]': 100000000 hosts; at most 65536", None),
    "a[1-300]b[1-300]": ("90000 hosts; at most 65536", 90000),  # our bound, not Slurm's
    "x" * 252 + "[1-10]": ("names of up to 254 characters; a host name has at most 253", 10),
}


@pytest.mark.parametrize("entry", REFUSED, ids=[e[:30] for e in REFUSED])
def test_refused_entries_are_one_value_error_naming_them(entry: str) -> None:
    with pytest.raises(ValueError) as err:
        expand_hostlist(entry)
    assert REFUSED[entry][0] in str(err.value)
    assert "\n" not in str(err.value)


@needs_scontrol
@pytest.mark.parametrize("entry", [e for e in REFUSED if REFUSED[e][1] is not ...], ids=lambda e: e[:30])
def test_what_slurm_does_with_the_refused_entries(slurm: Slurm, entry: str) -> None:
    """The record of why each is refused: Slurm refuses it too, or reads it in a surprising way."""
    does = REFUSED[entry][1]
    got: Union[None, list[str], int] = slurm.hostnames(entry)
    if isinstance(does, int) and got is not None:
        got = len(got)
    assert got in (does if isinstance(does, tuple) else (does,))


def test_names_of_253_characters_are_kept() -> None:
    assert expand_hostlist("x" * 251 + "[1-10]") == ["x" * 251 + str(i) for i in range(1, 11)]


# --------------------------------------------------------------------------- bombs

@pytest.mark.parametrize("bomb", ["n[1-100000000]", "n[0-999999999999999999]", "n" + "[1-65536]" * 200,
                                  ",".join(["n[1-65536]"] * 200), "a[1-300]b[1-300]"])
def test_bombs_are_refused_before_they_expand(bomb: str) -> None:
    tracemalloc.start()
    try:
        with cpu_time() as took, pytest.raises(ValueError, match=f"; at most {MAX_HOSTS}$"):
            expand_hostlist(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # refused before expanding: 0.05-2.5 ms here, where expanding would take seconds
    cpu_within(took.seconds, 3, f"refusing the hostlist {bomb[:40]!r}")
    assert peak < 1 << 20, peak


def test_the_bound_is_on_the_whole_list() -> None:
    assert len(expand_hosts(["a[1-40000]", "b[1-25536]"])) == MAX_HOSTS
    with pytest.raises(ValueError, match=r"^'b\[1-40000\]': 40000 hosts; at most 25536 more "
                                         r"\(a list names at most 65536 in all\)$"):
        expand_hosts(["a[1-40000]", "b[1-40000]"])
    with pytest.raises(ValueError, match=r"^more than 65536 hosts \(from 'c' on\)"):
        expand_hosts(["a[1-40000]", "b[1-25536]", "c"])


def test_entries_that_are_not_hostlists_are_kept() -> None:
    entries = ["plain", "[::1]", "[fe80::1%eth0]", {"addr": "x"}, "10.0.0.1", "a,b", "g[1-2]"]
    assert expand_hosts(entries) == ["plain", "[::1]", "[fe80::1%eth0]", {"addr": "x"}, "10.0.0.1", "a", "b",
                                     "g1", "g2"]


# --------------------------------------------------------------------------- through the spec loader

def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / "toy_ddp.py").write_text("print('hi')\n")
    return path


@pytest.mark.parametrize("text, expected", [
    ("backend: ssh\nhosts:\n  - a1\n  - 'gpu[1-3'\n", ":2: hosts: 'gpu[1-3': '[' at character 4 without a closing ']'"),
    ("backend: ssh\nhosts: ['gpu[3-1]']\n", ":2: hosts: 'gpu[3-1]': range 3-1 runs backwards; write 'gpu[1-3]'"),
    ("backend: ssh\nhosts: ['gpu[1-a]']\n", ":2: hosts: 'gpu[1-a]': '1-a' in brackets is not a number"),
    ("backend: ssh\n\nhosts: ['n[1-100000000]']\n", ":3: hosts: 'n[1-100000000]': 100000000 hosts; at most 65536"),
    ("backend: ssh\nhosts: [a]\nrecovery:\n  spares: [b, 's[3-1]']\n",
     ":4: recovery.spares: 's[3-1]': range 3-1 runs backwards; write 's[1-3]'"),
])
def test_a_bad_hostlist_in_a_spec_is_one_line_with_key_and_line(tmp_path: Path, text: str, expected: str) -> None:
    path = _spec(tmp_path, text)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}{expected}"), str(err.value)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert f"ddplaunch: error: {path}{expected}" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_hostlists_in_a_spec_expand(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, """
        backend: ssh
        hosts: ["rack[1-2]-gpu[01-02]", "[::1]", "login1,login2"]
        recovery:
          spares: ["spare[1-2].x"]
    """))
    assert [h.addr for h in spec.hosts] == ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02", "[::1]",
                                            "login1", "login2"]
    assert isinstance(spec.recovery.spares, list)
    assert [h.addr for h in spec.recovery.spares] == ["spare1.x", "spare2.x"]
