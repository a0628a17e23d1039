"""The screen of real training scripts (output/screen.py, output/stagelines.py, output/console.py):
ddplaunch's own words (the heartbeat, the ranks' payloads) never reach the screen wherever they
land in a node's output — after a progress bar's partial line too — while every character the job
printed reaches the log; a bar redrawn with `\\r` is its newest state, not a stream of lines; empty,
padding-only and ANSI-laden pieces never show as prefixed lines."""

from __future__ import annotations

import io
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from ddplaunch.output.console import BAR_EVERY_S, Console
from ddplaunch.output.screen import pieces, screen_text
from ddplaunch.output.stagelines import StageLines
from ddplaunch.output.torchrun import HEARTBEAT
from ddplaunch.output.who import OutputLine

HOST = "h1"
#: Anything of ddplaunch's own that must never be seen on the screen.
PROTOCOL_RE = re.compile(r"DDPLAUNCH_[A-Z]+")


def _lines() -> tuple[StageLines, io.StringIO, io.StringIO]:
    screen, log = io.StringIO(), io.StringIO()
    return StageLines(Console(screen, log)), screen, log


def test_a_bar_glued_to_the_heartbeat_shows_its_newest_state_and_no_marker():
    lines, screen, log = _lines()
    lines.emit(0, HOST, f"[{HOST}:0] \r 93%|█████████▎| 560/600 [02:29<00:18, 1.8it/s]\r 94%|█████████▍| 567/600 "
                        f"[02:30<00:18,  1.82it/s]{HEARTBEAT}\r\n")
    lines.emit(0, HOST, f"[{HOST}:0] \x1b[A\x1b[2K   \n")  # a cursor move and padding: nothing to show
    lines.emit(0, HOST, "\n")
    lines.console.flush()
    shown = screen.getvalue().splitlines()
    assert shown == [f"[{HOST}:0]  94%|█████████▍| 567/600 [02:30<00:18,  1.82it/s]"], shown
    assert "560/600" in log.getvalue() and HEARTBEAT not in log.getvalue()  # the log has every redraw
    assert lines.heard_at[0] > 0  # the heartbeat counted


def test_a_rank_prefix_inside_a_line_starts_a_line_of_its_own():
    got = pieces(f"[{HOST}:0]  34%|███▍      | 206/600 [00:02<00:01, 210.63it/s][{HOST}:0] {{'loss': '4.707'}}", HOST)
    assert [(p.rank, p.shown) for p in got] == [(0, " 34%|███▍      | 206/600 [00:02<00:01, 210.63it/s]"),
                                                (0, "{'loss': '4.707'}")]
    assert "".join(p.raw for p in got).count("206/600") == 1


def test_a_loggers_line_written_after_a_bar_is_a_line_of_its_own_folded_with_the_other_ranks():
    """Hugging Face's Trainer draws its bar (no newline), then transformers' logger warns on every
    rank: rank 0's warning lands after its bar, in the same line."""
    lines, screen, log = _lines()
    warning = "[transformers] `loss_type=None` was set in the config but it is unrecognized."
    lines.emit(0, HOST, f"[{HOST}:0]   0%|          | 0/600 [00:00<?, ?it/s]{warning}")
    lines.emit(1, "h2", f"[h2:1] {warning}")
    lines.emit(2, "h3", f"[h3:2] {warning}")
    lines.console.flush()
    assert screen.getvalue().splitlines() == [f"[{HOST}:0]   0%|          | 0/600 [00:00<?, ?it/s]",
                                              f"[x3 ranks: {HOST}:0, h2:1, h3:2] {warning}"]
    assert log.getvalue().splitlines()[0] == f"[{HOST}:0]   0%|          | 0/600 [00:00<?, ?it/s]{warning}"
    assert lines.rank_tail(0) == [OutputLine(HOST, 0, 0, "  0%|          | 0/600 [00:00<?, ?it/s]"),
                                  OutputLine(HOST, 0, 0, warning)]


def test_a_bars_own_text_after_its_times_is_not_a_line_of_every_redraw():
    """A `bar_format` that ends with text after the times: the same shape after every redraw is
    the bar's, shown once at most, not a line per redraw."""
    lines, screen, _ = _lines()
    for i in range(1, 11):
        lines.emit(0, HOST, f"[{HOST}:0] {i * 10}%|{'#' * i}{' ' * (10 - i)}| {i}/10 [00:0{i}] loss={1 / i:.3f}")
    lines.console.flush()
    assert len([line for line in screen.getvalue().splitlines() if "loss=" in line and "%|" not in line]) <= 1


def test_a_full_bar_redrawn_as_it_closes_after_another_bar_is_printed_once():
    """The Trainer's bar is full, its checkpoint's "Writing model shards" bar fills, then the
    Trainer closes its bar (redrawn full once more)."""
    lines, screen, _ = _lines()
    done = f"[{HOST}:0] 100%|██████████| 1200/1200 [00:11<00:00, "
    for line in (done + "74.64it/s]", f"[{HOST}:0] Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 257.87it/s]",
                 done + "97.37it/s]"):  # its rate, redrawn, is another
        lines.emit(0, HOST, line)
    lines.console.flush()
    assert [line for line in screen.getvalue().splitlines() if line.startswith(done)] == [done + "74.64it/s]"]


def test_pytorchs_cpp_warning_from_every_rank_is_one_line_without_its_time():
    lines, screen, log = _lines()
    for rank, host in enumerate([HOST, "h2", "h3"]):
        lines.emit(rank, host, f"[{host}:{rank}] [rank{rank}]:[W1205 20:57:37.17{rank}484652 reducer.cpp:1529] "
                               "Warning: find_unused_parameters=True was specified in DDP constructor")
    lines.console.flush()
    assert screen.getvalue().splitlines() == [
        f"[x3 ranks: {HOST}:0, h2:1, h3:2] [W reducer.cpp:1529] Warning: find_unused_parameters=True was "
        "specified in DDP constructor"]
    assert "[rank2]:[W1205 20:57:37.172484652 reducer.cpp:1529]" in log.getvalue()  # the log as it came


def test_a_payload_after_a_partial_line_is_read_and_the_text_before_it_kept():
    lines, screen, log = _lines()
    lines.emit(0, HOST, f'[{HOST}:0] epoch 3 done DDPLAUNCH_PROGRESS_JSON {{"rank": 0, "steps": 7}}')
    lines.console.flush()
    assert screen.getvalue().splitlines() == [f"[{HOST}:0] epoch 3 done"]
    assert lines.progress is not None and lines.progress.optimizer_steps == 7


def test_a_bar_off_a_terminal_is_shown_every_few_seconds_and_when_full(monkeypatch):
    from ddplaunch.output import console as console_module

    clock = [100.0]
    monkeypatch.setattr(console_module.time, "monotonic", lambda: clock[0])
    lines, screen, _ = _lines()
    for i in range(1, 11):
        clock[0] += BAR_EVERY_S / 4
        lines.emit(0, HOST, f"[{HOST}:0] {i * 10}%|{'█' * i}{' ' * (10 - i)}| {i}/10 [00:0{i}<00:00, 1it/s]")
    lines.emit(0, HOST, f"[{HOST}:0] 100%|██████████| 10/10 [00:10<00:00, 1it/s]")  # redrawn as it closes
    shown = screen.getvalue().splitlines()
    assert shown[0] == f"[{HOST}:0] 10%|█         | 1/10 [00:01<00:00, 1it/s]"
    assert shown[-1] == f"[{HOST}:0] 100%|██████████| 10/10 [00:010<00:00, 1it/s]"
    assert len(shown) == 4, shown  # 10%, 50%, 90% (every 10 s at one redraw each 2.5 s), then the full bar once


#: What a job may print: text, partial lines, redraws, ANSI sequences, padding, and words that
#: look like ddplaunch's own.
CHUNKS = st.lists(st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=30),
    st.sampled_from(["\r", "\x1b[A", "\x1b[2K", "\x1b[31m", "\x1b[0m", "   ", "\t", "\x1b]0;title\x07",
                     "DDPLAUNCH_", "DDPLAUNCH_ALIVE", "DDPLAUNCH_X_JSON {", " 50%|█████     | 5/10"]),
), max_size=12)


@settings(max_examples=300, deadline=None)
@given(chunks=CHUNKS, heartbeat_at=st.integers(min_value=0, max_value=12), rank=st.integers(0, 7))
def test_fuzz_the_screen_never_shows_protocol_and_the_log_keeps_the_jobs_text(chunks, heartbeat_at, rank):
    job = "".join(chunks)
    words = [w for w in re.split(r"[\x00-\x1f\x7f\s]+", job) if w and "DDPLAUNCH" not in w]
    glued = "".join(chunks[:heartbeat_at]) + HEARTBEAT + "".join(chunks[heartbeat_at:])
    lines, screen, log = _lines()
    lines.emit(rank % 2, HOST, f"[{HOST}:{rank}] {glued}")
    lines.emit(rank % 2, HOST, f"[{HOST}:{rank}] {job}" + ' DDPLAUNCH_PROGRESS_JSON {"rank": 0, "steps": 3}')
    lines.console.flush()
    shown = screen.getvalue()
    assert HEARTBEAT not in shown and "DDPLAUNCH_PROGRESS_JSON" not in shown, shown
    assert "DDPLAUNCH" in job or not PROTOCOL_RE.search(shown), shown
    for line in shown.splitlines():
        assert line.startswith(f"[{HOST}:{rank}] ") and line[len(f"[{HOST}:{rank}] "):].strip(), repr(line)
        assert line.count(f"[{HOST}:{rank}] ") == 1 or job.count(f"[{HOST}:") > 0, repr(line)
        assert screen_text(line) == line  # no control character or ANSI sequence reaches the screen
    logged = log.getvalue()
    for word in words:  # every word the job printed is in the log, whole
        assert word in logged.replace(HEARTBEAT, ""), (word, logged)


def test_on_a_terminal_each_ranks_bar_is_one_live_line_and_a_full_one_is_printed_once():
    from ddplaunch.output.console import LiveConsole

    screen, log = io.StringIO(), io.StringIO()
    console = LiveConsole(screen, log, [HOST])
    try:
        def rank(r: int, text: str) -> OutputLine:
            return OutputLine(HOST, 0, r, text)

        for i in (1, 5, 9):
            console.bar(rank(0, f"raw {i}"), rank(0, f"{i * 10}%|█| {i}/10 [00:0{i}<00:00, 1it/s]"))
        console.bar(rank(1, "raw"), rank(1, "30%|█| 3/10 [00:03<00:00, 1it/s]"))
        assert {key: str(bar) for key, bar in console.live_bars.items()} == {
            (HOST, 0): f"[{HOST}:0] 90%|█| 9/10 [00:09<00:00, 1it/s]",
            (HOST, 1): f"[{HOST}:1] 30%|█| 3/10 [00:03<00:00, 1it/s]"}
        for _ in range(2):  # the full bar, then its redraw as it closes
            console.bar(rank(0, "raw 10"), rank(0, "100%|█| 10/10 [00:10<00:00, 1it/s]"))
        assert list(console.live_bars) == [(HOST, 1)]  # the full one left the live lines, printed once
    finally:
        console.close()
    assert screen.getvalue().count("10/10 [00:10") == 1 and "9/10" not in screen.getvalue().split("10/10")[-1]
    assert log.getvalue().splitlines() == [f"[{HOST}:0] raw 1", f"[{HOST}:0] raw 5", f"[{HOST}:0] raw 9",
                                           f"[{HOST}:1] raw", f"[{HOST}:0] raw 10", f"[{HOST}:0] raw 10"]


def test_a_terminal_shows_the_jobs_steps_live_whatever_it_prints():
    """Rank 0's optimizer steps, counted inside its process (its payload), are a live line on a
    terminal: a job whose own bar is hidden off a terminal (Lightning's) still shows progress."""
    from rich.console import Console as RichConsole

    from ddplaunch.output.console import LiveConsole

    console = LiveConsole(io.StringIO(), None, [HOST])
    try:
        lines = StageLines(console)
        for steps in (10, 50):
            lines.emit(0, HOST, f'[{HOST}:0] DDPLAUNCH_PROGRESS_JSON {{"rank": 0, "steps": {steps}}}')
        shown = RichConsole(file=io.StringIO(), width=120)
        with shown.capture() as capture:
            shown.print(console._live())
    finally:
        console.close()
    assert "job: step 50" in capture.get()


def test_ranks_at_the_same_count_of_the_same_bar_are_one_live_line():
    """Every rank of a DDP job draws the same bar at the same count: one live line says them all
    (the newest, and how many more); a rank ahead or behind, or another bar, has its own line; at
    most LIVE_BARS lines, the newest."""
    from ddplaunch.output.console import LIVE_BARS, fold_bars

    bars = [OutputLine(f"h{r // 8}", r // 8, r, f"45%|████ | 45/100 [00:09<00:11, {5 + r % 3}it/s]") for r in range(64)]
    assert fold_bars(bars) == [f"{bars[-1]} (+63 ranks at 45/100)"]
    ahead = OutputLine("h9", 9, 72, "46%|████ | 46/100 [00:09<00:11, 5it/s]")
    other = OutputLine("h0", 0, 0, "eval 3/9 [00:01<00:02, 1it/s]")
    assert fold_bars([*bars, ahead, other]) == [f"{bars[-1]} (+63 ranks at 45/100)", str(ahead), str(other)]
    many = [OutputLine(f"h{r}", r, r, f"{r}%|█ | {r}/100 [00:01<00:02, 1it/s]") for r in range(20)]
    assert fold_bars(many) == [str(bar) for bar in many[-LIVE_BARS:]]
    nodes = [OutputLine(f"h{n}", n, None, "45%|████ | 45/100 [00:09<00:11, 5it/s]") for n in range(2)]
    assert fold_bars(nodes) == [str(bar) for bar in nodes]  # the nodes' own bars: not folded as ranks
