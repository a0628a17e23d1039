"""The run page (`ddplaunch report RUN_ID --html FILE`, runpage.py): one self-contained HTML file —
no script, nothing fetched — with a line per rank of its step times, the health check's busbw per
size, the pair bandwidth heatmap and the timeline; every value from the run escaped. The page of a
real run is checked in test_supervisor.py."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

from ddplaunch.record.events import (EventLog, RankSteps, RecoveryStarted, RunEnded, RunStarted, StageStarted,
                                     StragglerNamed)
from ddplaunch.report.page import render


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _run_dir(tmp_path, host="h2"):
    log = EventLog(tmp_path)
    for e in [RunStarted("r1", "ssh", ["h1", host], 1, "me", t=100.0), StageStarted("job", "h1", 1, ["h1", host], t=101.0),
              *[RankSteps("h1", 0, s, 0.2, 0.1, t=101.0 + s) for s in range(1, 6)],
              *[RankSteps(host, 1, s, 0.2, 0.01, t=101.0 + s) for s in range(1, 6)],
              StragglerNamed(host, [1], 0.8, 2, 0.19, 0.1, 0.1, t=104.0),
              RecoveryStarted(1, [host], {host: "h3"}, ["h1", "h3"], t=105.0),
              RunEnded("ok", 0, summary="run r1: ok (exit 0)", t=110.0)]:
        log.append(e)
    log.close()
    (tmp_path / "healthcheck.json").write_text(json.dumps({
        "bandwidth": [{"bytes": 65536, "busbw_gbps": 0.5, "collective": "all_reduce"},
                      {"bytes": 1 << 20, "busbw_gbps": 1.5, "collective": "all_reduce"}],
        "pairs": {"pairs": [{"hosts": ["h1", host], "ok": True, "busbw_gbps": 1.0},
                            {"hosts": ["h1", "h3"], "ok": False, "busbw_gbps": None}]}}))
    return tmp_path


def test_the_page_has_every_plot_and_needs_nothing_from_the_network(tmp_path):
    page = render(_run_dir(tmp_path))
    parser = _Tags()
    parser.feed(page)
    tags = parser.tags
    assert not [t for t, a in tags if t in ("script", "link", "img", "iframe")]
    assert not re.search(r"(src|href)=", page)
    assert {a["data-rank"] for t, a in tags if t == "polyline"} == {"0", "1"}
    assert len([a for t, a in tags if t == "rect" and a.get("class") == "busbw"]) == 2
    assert len([a for t, a in tags if t == "rect" and a.get("class") == "pair"]) == 4  # both halves of 2 pairs
    assert "<h1>run r1: ok (exit 0)</h1>" in page
    assert "straggler h2 (rank 1): 80% slower since step 2" in page and "recovery 1: h2 lost; h2 → h3" in page


def test_every_value_from_the_run_is_escaped(tmp_path):
    page = render(_run_dir(tmp_path, host="<b>evil</b>&"))
    assert "<b>evil" not in page and "&lt;b&gt;evil&lt;/b&gt;&amp;" in page


def test_a_run_without_timing_says_so(tmp_path):
    log = EventLog(tmp_path)
    log.append(RunStarted("r2", "local", ["localhost"], 1, "me"))
    log.close()
    page = render(tmp_path)
    assert "No rank reported its steps" in page and "running (no end in its log yet)" in page
