"""The link test's verdict (linktest.judge): a host is named only when it reaches no peer and no
peer reaches it while the others reach each other; anything less clear names nobody. The run's
spares are witnesses (judge_run): they let two hosts tell which one is cut, are never named
themselves, and one that gave no answer is left out. The real
link test runs in tests/run/test_recovery.py (a host whose training traffic is cut)."""

from __future__ import annotations

from ddplaunch.diagnose.links import FULL_MESH_UP_TO, judge, judge_run, peers_of

ADDRS = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "d": "10.0.0.4"}


def _answers(links: set[tuple[str, str]], labels=ADDRS) -> dict:
    """Each host's answer, given the (from, to) connections that succeeded."""
    return {h: {"reached": sorted(ADDRS[b] for a, b in links if a == h), "came_from": []} for h in labels}


def _full(labels) -> set[tuple[str, str]]:
    return {(a, b) for a in labels for b in labels if a != b}


def test_a_host_cut_off_from_every_peer_is_named_with_the_peers_that_reach_each_other():
    verdict = judge(ADDRS, _answers(_full("acd")), 29500)
    assert list(verdict) == ["b"]
    assert "no TCP connection to or from a, c, d on port 29500" in verdict["b"]


def test_healthy_links_name_nobody():
    assert judge(ADDRS, _answers(_full("abcd")), 1) == {}


def test_a_host_with_one_working_link_is_not_named():
    links = _full("acd") | {("b", "c")}
    assert judge(ADDRS, _answers(links), 1) == {}


def test_a_split_in_two_names_nobody():
    assert judge(ADDRS, _answers(_full("ab") | _full("cd")), 1) == {}


def test_two_hosts_cannot_tell_which_one_is_cut():
    two = {k: ADDRS[k] for k in "ab"}
    assert judge(two, _answers(set(), two), 1) == {}


def test_a_host_without_an_answer_makes_the_test_inconclusive():
    answers = _answers(_full("acd"))
    answers["c"] = None
    assert judge(ADDRS, answers, 1) == {}


def test_a_spare_as_witness_tells_which_of_two_hosts_is_cut():
    # the run: a and b; the spare c reaches a and a reaches c, nobody reaches b
    verdict = judge_run(["a", "b"], {k: ADDRS[k] for k in "abc"}, _answers(_full("ac"), "abc"), 1)
    assert list(verdict) == ["b"] and "no TCP connection to or from a, c on port 1" in verdict["b"]


def test_a_cut_witness_is_never_named_and_a_silent_one_is_left_out():
    three = {k: ADDRS[k] for k in "abcd"}
    # the spare d cut off: the run's hosts reach each other, nobody is named
    assert judge_run(["a", "b", "c"], three, _answers(_full("abc")), 1) == {}
    # the spare d gave no answer (dead while it waited): b is still named from a and c
    answers = _answers(_full("ac"))
    answers["d"] = None
    assert list(judge_run(["a", "b", "c"], three, answers, 1)) == ["b"]
    # but a run host without an answer keeps the test inconclusive
    answers["c"] = None
    assert judge_run(["a", "b", "c"], three, answers, 1) == {}


def test_the_judge_names_the_one_cut_host_among_a_thousand():
    """At 1,000 hosts each answer lists ~1,000 peers: the judge looks each pair up once (a set, not
    a list scan: 10^6 lookups, not 10^9), and names the one host no peer reached."""
    addrs = {f"h{i}": f"10.1.{i // 250}.{i % 250}" for i in range(1000)}
    answers = {h: {"reached": [a for g, a in addrs.items() if g not in (h, "h7") and h != "h7"]} for h in addrs}
    assert list(judge(addrs, answers, 29400)) == ["h7"]


def test_past_a_small_run_each_host_tests_about_log2_peers_and_every_host_is_tested_both_ways():
    """A full mesh at 1,000 hosts is 10^6 connections and 999 threads a host: each host tests the
    hosts at offsets 1, 2, 4, ... after it instead, 10 out and 10 in."""
    small = [f"h{i}" for i in range(FULL_MESH_UP_TO)]
    assert all(len(p) == FULL_MESH_UP_TO - 1 for p in peers_of(small).values())
    labels = [f"h{i}" for i in range(1000)]
    peers = peers_of(labels)
    assert {len(p) for p in peers.values()} == {10}
    into = {h: 0 for h in labels}
    for mine in peers.values():
        for p in mine:
            into[p] += 1
    assert set(into.values()) == {10}


def test_a_cut_host_among_a_thousand_is_named_from_its_sampled_links_alone():
    addrs = {f"h{i}": f"10.1.{i // 250}.{i % 250}" for i in range(1000)}
    peers = peers_of(list(addrs))
    answers = {h: {"reached": [addrs[p] for p in peers[h] if "h7" not in (h, p)]} for h in addrs}
    verdict = judge(addrs, answers, 29400, peers)
    assert list(verdict) == ["h7"]
    # its 20 links (10 out, 10 in), the first 8 named
    assert "no TCP connection to or from h3, h5, h6, h8, h9, h11, h15, h23 and 12 more on port 29400" in verdict["h7"]
    # one more link between two healthy hosts down: inconclusive, nobody named
    answers["h500"]["reached"].remove(addrs[peers["h500"][0]])
    assert judge(addrs, answers, 29400, peers) == {}
