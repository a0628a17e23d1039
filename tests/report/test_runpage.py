"""The run page (`ddplaunch report RUN_ID --html FILE`, report/page.py): one self-contained HTML file —
no script, nothing fetched — with every host's compute per window against the median host's (a
band, and a line for a straggler), the health check's busbw per size, the pair bandwidth heatmap
and the timeline; every value from the run escaped. The page of a
real run is checked in test_supervisor.py."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from ddplaunch.record.diagnosis import BandwidthRow, HealthVerdict, Localization, Probe
from ddplaunch.record.events import EventLog, RunEnded, RunStarted, StageStarted, StepWindow
from ddplaunch.record.results import NodeState, RunState
from ddplaunch.report.page import page_of as render
from tests.events_util import recovery_started, stage_ended, straggler_named


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _run_dir(tmp_path, host="h2"):
    log = EventLog(tmp_path)
    checked = stage_ended({"h1": NodeState.OK, host: NodeState.OK}, {"h1": 0, host: 0}, t=101.5)
    checked.result.ran_healthcheck = True
    checked.result.healthcheck = HealthVerdict(
        ok=True, bandwidth=[BandwidthRow("all_reduce", 65536, 0.5), BandwidthRow("all_reduce", 1 << 20, 1.5)],
        pairs=Localization(pairs=[Probe(("h1", host), True, 1.0), Probe(("h1", "h3"), False, None)]))
    for e in [RunStarted("r1", "ssh", ["h1", host], 1, "me", t=100.0), StageStarted("job", "h1", 1, ["h1", host], t=101.0),
              *[StepWindow(20 * w + 1, 20 * w + 20, {"h1": [0.1, 0.1, 0.2], host: [0.19, 0.01, 0.2]}, t=101.0 + w)
                for w in range(1, 6)],
              straggler_named(host, [1], 0.8, 2, 0.19, 0.1, 0.1, t=104.0),
              checked, recovery_started(1, [host], {host: "h3"}, ["h1", "h3"], t=105.0),
              RunEnded(RunState.OK, 0, t=110.0)]:
        log.append(e)
    log.close()
    return tmp_path


def test_the_page_has_every_plot_and_needs_nothing_from_the_network(tmp_path):
    page = render(_run_dir(tmp_path))
    parser = _Tags()
    parser.feed(page)
    tags = parser.tags
    assert not [t for t, a in tags if t in ("script", "link", "img", "iframe")]
    assert not re.search(r"(src|href)=", page)
    assert {a["data-host"] for t, a in tags if t == "polyline" and a.get("class") == "host"} == {"h2"}
    assert [a.get("class") for t, a in tags if t == "polygon"] == ["band"]
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
    assert "No window of steps was judged" in page and "running (no end in its log yet)" in page


def test_an_interrupted_run_is_interrupted_on_its_page_as_in_its_summary(tmp_path):
    """The timeline and the summary say the same of each stage and of the run: both render the
    same typed state (an interrupted stage is not called FAILED on the page)."""
    from ddplaunch.record.events import read_events
    from ddplaunch.record.view import RunView
    from ddplaunch.report.summary import summarize

    log = EventLog(tmp_path)
    for e in [RunStarted("r3", "ssh", ["h1", "h2"], 1, "me", t=100.0),
              StageStarted("job", "h1", 1, ["h1", "h2"], t=101.0),
              stage_ended({"h1": NodeState.INTERRUPTED, "h2": NodeState.INTERRUPTED}, {"h1": 130, "h2": 130},
                          t=102.0, interrupted=True),
              RunEnded(RunState.INTERRUPTED, 130, t=103.0)]:
        log.append(e)
    log.close()
    page, summary = render(tmp_path), summarize(RunView.of(read_events(tmp_path)))
    assert "stage job: INTERRUPTED on 2 of 2 node(s)" in summary and summary.endswith("run r3: interrupted (exit 130)")
    assert "stage job INTERRUPTED" in page and "FAILED" not in page
    assert "<h1>run r3: interrupted (exit 130)</h1>" in page


def test_busbw_is_on_a_log_axis_so_small_messages_show_and_the_axes_have_ticks():
    from ddplaunch.report.page import busbw_plot

    plot = busbw_plot(HealthVerdict(ok=True, bandwidth=[BandwidthRow("all_reduce", 4096, 0.004),
                                                        BandwidthRow("all_reduce", 8 << 20, 8.0)]))
    parser = _Tags()
    parser.feed(plot)
    small, large = [float(a["height"]) for t, a in parser.tags if t == "rect" and a.get("class") == "busbw"]
    assert large > small > large / 10  # on a linear axis the 4 KiB bar would be 1/2000 of the 8 MiB one
    labels = re.findall(r'text-anchor="end" font-size="10">([^<]+)<', plot)
    assert labels == ["0.001", "0.01", "0.1", "1", "10"] and "log scale" in plot


def test_the_step_plot_has_time_ticks(tmp_path):
    page = render(_run_dir(tmp_path))
    ticks = re.findall(r'class="tick" x1="[\d.]+" y1="\d+" x2="[\d.]+" y2="\d+" stroke="#333"/><text [^>]*>([^<]+)<', page)
    assert ticks == ["0s", "2s", "3s", "4s", "6s"], ticks  # the x axis (y1 an integer): the windows span 6 s


def test_the_step_plots_ratio_axis_has_round_ticks_past_its_highest_value():
    from ddplaunch.report.page import _ratio_ticks

    top, ticks = _ratio_ticks(2.3)
    assert top == 2.5 and [label for _, label in ticks] == ["0x", "0.5x", "1x", "1.5x", "2x", "2.5x"]
    top, ticks = _ratio_ticks(13)
    assert top == 15 and [label for _, label in ticks] == ["0x", "5x", "10x", "15x"] and ticks[-1][0] == 1.0
