"""One line per cluster: the console shows a line many ranks print once, with who printed it;
the log keeps every line; `verbose` shows them all as they come."""

from __future__ import annotations

import io

from ddplaunch.output import console as console_mod
from ddplaunch.output.console import Console
from ddplaunch.output.who import OutputLine, read_line
from tests.torchrun_util import wait_for


def said(text: str) -> OutputLine:
    """A host's line, as StageLines reads it: `[host:rank] text` or `[host] text`."""
    line = read_line(text)
    assert line is not None
    return line


def _console(verbose: bool = False) -> tuple[Console, io.StringIO, io.StringIO]:
    out, log = io.StringIO(), io.StringIO()
    return Console(out, log=log, verbose=verbose), out, log


def _every_rank(con: Console, text: str, hosts: int = 3, per_host: int = 2) -> None:
    for h in reversed(range(hosts)):  # the last host first: the line names them in rank order anyway
        for local in range(per_host):
            con.line(said(f"[dle{h}:{h * per_host + local}] {text}"), shown=True)


def test_a_line_every_rank_prints_is_shown_once_with_the_ranks():
    con, out, log = _console()
    _every_rank(con, "UserWarning: something about TF32")
    con.close()
    assert out.getvalue() == "[x6 ranks: dle0:0-1, dle1:2-3, dle2:4-5] UserWarning: something about TF32\n"
    assert log.getvalue().count("UserWarning: something about TF32") == 6


def test_a_line_all_8192_ranks_print_is_one_short_line_with_the_ranks_and_the_hosts_count():
    """1,024 hosts x 8 ranks: one line of bounded length (the hosts counted, not named), built
    in time that grows with the ranks, not their square (each rank's line checked in O(1))."""
    con, out, log = _console()
    _every_rank(con, "UserWarning: something about TF32", hosts=1024, per_host=8)
    con.close()
    assert out.getvalue() == "[x8192 ranks: 0-8191 on 1024 hosts] UserWarning: something about TF32\n"
    assert log.getvalue().count("\n") == 8192


def test_verbose_shows_every_line_as_it_comes():
    con, out, _ = _console(verbose=True)
    _every_rank(con, "hello")
    assert out.getvalue().count("hello") == 6  # at once: nothing waits


def test_different_lines_keep_their_order_and_lone_lines_stay_as_printed():
    con, out, _ = _console()
    con.line(said("[a:0] step 1"), shown=True)
    con.line(said("[a:0] config: lr=0.1"), shown=True)
    con.line(said("[b:1] config: lr=0.1"), shown=True)
    con.line(said("[b] host line"), shown=True)
    con.line(said("[c] host line"), shown=True)
    con.line(said("[a:0] hidden"), shown=False)
    con.note("done")  # ddplaunch's own lines come after what waits
    assert out.getvalue().splitlines() == ["[a:0] step 1", "[x2 ranks: a:0, b:1] config: lr=0.1",
                                           "[x2 hosts: b, c] host line", "[ddplaunch] done"]


def test_the_same_rank_printing_a_line_again_is_a_new_line():
    con, out, _ = _console()
    for _ in range(3):
        con.line(said("[a:0] tick"), shown=True)
    con.line(said("[a:1] tick"), shown=True)
    con.close()
    assert out.getvalue().splitlines() == ["[a:0] tick", "[a:0] tick", "[x2 ranks: a:0-1] tick"]


def test_a_waiting_line_is_shown_after_the_window_without_more_output(monkeypatch):
    monkeypatch.setattr(console_mod, "FOLD_S", 0.2)
    con, out, _ = _console()
    con.line(said("[a:0] alone"), shown=True)
    con.line(said("[a:1] alone"), shown=True)
    assert out.getvalue() == ""  # within the window: waiting for the other ranks
    wait_for(lambda: out.getvalue() == "[x2 ranks: a:0-1] alone\n", timeout=5)
