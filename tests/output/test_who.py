"""A node's line is read once, where it comes in, into a typed line (output/who.py): its host, its
node, its rank and its text. Every later reader uses the fields; one module renders the prefix."""

from __future__ import annotations

import io

import pytest

from ddplaunch.output.console import Console
from ddplaunch.output.stagelines import StageLines
from ddplaunch.output.torchrun import finding_lines, rank_cause
from ddplaunch.output.who import OutputLine, prefix, prefix_at, rank_starts, read_line
from ddplaunch.plan.launch import Stage
from ddplaunch.record.results import NodeOutcome, StageResult


def test_a_line_renders_the_prefix_torchrun_and_ddplaunch_put_on_it():
    assert str(OutputLine("h1", 0, 3, "step=1")) == "[h1:3] step=1"
    assert str(OutputLine("h1", 0, None, "torchrun says")) == "[h1] torchrun says"
    assert prefix("h1", 0) == "[h1:0] " and prefix("h1") == "[h1] "
    assert OutputLine("h1", 2, 5, "a").with_body("b") == OutputLine("h1", 2, 5, "b")


@pytest.mark.parametrize("text, found", [
    ("[h1:12] x", (12, 8)), ("[h1] x", (None, 5)), ("[h1:] x", None), ("[h1:1x] x", None),
    ("[h1:3]x", None), ("[h10:3] x", None), ("[h1", None), ("h1:3] x", None), ("[h1:²] x", None),
])
def test_the_prefix_of_this_nodes_host_is_read_by_string_comparison(text, found):
    assert prefix_at(text, "h1") == found


def test_a_ranks_prefix_inside_a_line_is_found_where_it_begins():
    line = "[h1:0] 34%|█ | 2/6 [00:02<00:01][h1:0] {'loss': 4.7} [h1:x] no [h2:1] other host[h1:1] y"
    assert [line[at:at + 7] for at in rank_starts(line, "h1")] == ["[h1:0] ", "[h1:1] "]
    assert rank_starts("[h1:0] at the start only", "h1") == []


def test_a_logged_line_is_read_back_without_its_node():
    assert read_line("[h1:7] text [with] brackets") == OutputLine("h1", None, 7, "text [with] brackets")
    assert read_line("[h1] the node's own") == OutputLine("h1", None, None, "the node's own")
    assert read_line("no prefix") is None


def _read(*lines: tuple[int, str, str]) -> StageLines:
    stage = StageLines(Console(io.StringIO(), io.StringIO()))
    for node, host, line in lines:
        stage.emit(node, host, line)
    stage.console.flush()
    return stage


def test_a_nodes_lines_are_read_once_into_typed_lines_with_their_node():
    stage = _read((1, "h2", "[h2:5] hello"), (1, "h2", "torchrun's own words"),
                  (1, "h2", "[h2:5] half a line[h2:4] the next rank's line"))
    assert stage.rank_tail(5) == [OutputLine("h2", 1, 5, "hello"), OutputLine("h2", 1, 5, "half a line")]
    assert stage.rank_tail(4) == [OutputLine("h2", 1, 4, "the next rank's line")]
    assert stage.tail(1) == ["[h2:5] hello", "[h2] torchrun's own words", "[h2:5] half a line",
                             "[h2:4] the next rank's line"]


def test_a_ranks_text_that_looks_like_another_prefix_stays_its_text():
    """Only this node's host starts a rank's line: `[h9:3] ` printed by a rank of h2 is its text."""
    stage = _read((0, "h2", "[h2:0] [h9:3] copied from elsewhere"))
    assert stage.rank_tail(0) == [OutputLine("h2", 0, 0, "[h9:3] copied from elsewhere")]
    assert stage.rank_tail(3) == []


def test_findings_are_condensed_from_the_lines_fields():
    fp = ("CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[{}], TensorDtypes={}, "
          "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))")
    mismatch = (f"[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running "
                f"collective: {fp.format(4, 'Float')}, but Rank 0 is running collective: {fp.format(8, 'Double')}.")
    store = "torch.distributed.DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined."
    stage = _read((1, "dlt2", f"[dlt2:1] {mismatch}"), (0, "dlt1", store), (0, "dlt1", f"[dlt1:0] {store}"))
    assert stage.findings == [OutputLine("dlt2", 1, 1, mismatch), OutputLine("dlt1", 0, None, store),
                              OutputLine("dlt1", 0, 0, store)]
    said = ["dlt2 rank 1: collective mismatch (TORCH_DISTRIBUTED_DEBUG=DETAIL): "
            "rank 1 ALLREDUCE [4] Float vs rank 0 ALLREDUCE [8] Double",
            "dlt1: DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined.",
            "dlt1 rank 0: DistStoreError: Timed out after 31 seconds waiting for clients. 1/2 clients joined."]
    assert finding_lines(stage.findings) == said
    result = stage.fill(StageResult(Stage.JOB, [NodeOutcome(0, "dlt1"), NodeOutcome(1, "dlt2")]))
    assert result.findings == [str(line) for line in stage.findings]  # the record keeps them as shown


def test_a_host_named_with_colons_is_its_lines_host():
    """An IPv6 host's label: the old reader of the rendered line gave up on its `:`s."""
    line = OutputLine("fe80::1", 0, 2, "torch.distributed.DistNetworkError: Connection reset")
    assert finding_lines([line]) == ["fe80::1 rank 2: DistNetworkError: Connection reset"]


def test_a_ranks_cause_is_the_text_of_its_lines():
    lines = [OutputLine("h1", 0, 0, text) for text in
             ("step=1", "Traceback (most recent call last):", '  File "x.py", line 1, in f', "ValueError: bad")]
    assert rank_cause(lines) == ["Traceback (most recent call last):", '  File "x.py", line 1, in f',
                                 "ValueError: bad"]
