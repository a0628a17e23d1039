"""The reports shown in docs/troubleshooting.md are what the code prints.

Each example there is a fenced block after a marker naming the test whose real run it came from
and the host names of that run:

    <!-- example: hang from tests/run/test_fault_matrix.py::test_hang... hosts=dlt1,dlt2 -->

That test calls `check_doc_example(name, output, hosts, pick)` with its run's output: every line
of the block must appear in the output, compared after host names, paths, run ids and digits are
replaced by placeholders (so `5s` and `5.0s` still differ); pytest's temporary directories are
shown as /tmp/t. `pick` selects the output lines an
example shows (the summary lines that do not vary between runs). `UPDATE_DOCS=1 pytest ...`
rewrites the blocks from the runs instead (never in CI); review the diff before committing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
MARK = re.compile(r"<!-- example: (?P<name>\S+) from (?P<test>\S+) hosts=(?P<hosts>\S*) -->\n```\n(?P<body>.*?)```\n",
                  re.S)
#: An absolute path (not inside a word), up to a space, colon, comma or closing bracket.
PATH_RE = re.compile(r"(?<![\w.\-/])/[^\s:,)\]]+")
#: pytest's temporary directory, shortened in the examples (paths are compared as PATH anyway)
TMP_RE = re.compile(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+")
#: the hours and minutes of a duration (`1m00s` and `45s` are one format: a wall time crossing a minute)
LONG_DURATION = re.compile(r"(?<![\w.])(?:\d+h)?\d+m(?=\d+(?:\.\d+)?s\b)|(?<![\w.])\d+h(?=\d+(?:\.\d+)?s\b)")


def normalize(line: str, hosts: list[str]) -> str:
    for host in sorted(hosts, key=len, reverse=True):
        line = re.sub(rf"(?<![\w.\-]){re.escape(host)}(?![\w\-])", "HOST", line)
    line = PATH_RE.sub("PATH", line)
    line = re.sub(r"^run \S+:", "run RUN:", line)
    line = LONG_DURATION.sub("", line)
    return re.sub(r"\d+", "N", line.rstrip())


def blocks() -> dict[str, re.Match]:
    return {m["name"]: m for m in MARK.finditer(DOC.read_text())}


def check_doc_example(name: str, output: str, hosts: list[str], pick: list[str]) -> None:
    """Asserts docs/troubleshooting.md's example `name` matches `output` (or rewrites it)."""
    found = blocks().get(name)
    assert found is not None, f"{DOC.name} has no example marker for {name!r}"
    picked = [TMP_RE.sub("/tmp/t", line.rstrip()) for line in output.splitlines()
              if any(re.match(p, line) for p in pick)]
    assert picked, f"no line of the run matches {pick}: {output[-2000:]}"
    if os.environ.get("UPDATE_DOCS"):
        assert os.environ.get("CI", "").lower() not in ("1", "true", "yes"), "UPDATE_DOCS must never be set in CI"
        text = DOC.read_text()
        head = text[:found.start()] + f"<!-- example: {name} from {found['test']} hosts={','.join(hosts)} -->\n"
        DOC.write_text(head + "```\n" + "\n".join(picked) + "\n```\n" + text[found.end():])
        return
    doc_hosts = [h for h in found["hosts"].split(",") if h]
    seen = {normalize(line, hosts) for line in output.splitlines()}
    missing = [line for line in found["body"].splitlines()
               if line.strip() and normalize(line, doc_hosts) not in seen]
    assert not missing, (f"{DOC.name} example {name!r} shows lines this run does not print (refresh with "
                         f"UPDATE_DOCS=1 and review):\n" + "\n".join(missing) + "\n--- the run printed:\n"
                         + "\n".join(picked))
