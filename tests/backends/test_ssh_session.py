"""The SSH stage session's protocol, pure parts: a start gate's answer read from the lines before
"ready", and the "go" line that may name the ranks' network interface (never anything a shell
would read as more than a word). The whole session runs against the real sshd in test_ssh.py."""

from __future__ import annotations

import pytest

from ddplaunch.backends.ssh.session import go_line, split_check


def test_the_checks_answer_is_the_lines_before_its_exit_status():
    lines = ["Welcome to host a", "DDPLAUNCH_ANSWER_n1 {}", "abc123 checked 3", "cd noise"]
    assert split_check(lines, "abc123") == ((3, "Welcome to host a\nDDPLAUNCH_ANSWER_n1 {}"), ["cd noise"])


def test_a_check_that_never_ended_has_no_answer():
    lines = ["Welcome", "other checked 0"]  # another nonce's line is not this session's
    assert split_check(lines, "abc123") == (None, lines)


@pytest.mark.parametrize("name", ["eth0", "enp0s31f6", "ib0.8001", "bond0:1", "veth@if12"])
def test_go_names_an_interface(name):
    assert go_line(name) == f"go {name}\n".encode()
    assert go_line(None) == b"go\n"


@pytest.mark.parametrize("name", ["eth0; rm -rf ~", "$(id)", "a b", "-x", "", "x" * 40])
def test_go_refuses_what_is_not_an_interface_name(name):
    if name == "":
        assert go_line(name) == b"go\n"  # none found: the spec's own
        return
    with pytest.raises(ValueError):
        go_line(name)
