"""PS placement i* = argmax_i B[i,·]·p (§10), on small matrices by hand."""

from __future__ import annotations

import math

import pytest

from dips.algo.placement import best_placement, placement_scores


def test_small_matrix_by_hand():
    B = [[10, 1, 1], [5, 5, 5], [1, 1, 10]]
    p = [1, 2, 3]
    # row 0: 10 + 2 + 3 = 15; row 1: 5 + 10 + 15 = 30; row 2: 1 + 2 + 30 = 33
    assert placement_scores(B, p) == [15.0, 30.0, 33.0]
    assert best_placement(B, p) == (2, [15.0, 30.0, 33.0])


def test_not_the_single_fastest_link():
    # Row 0 has the fastest link (10) but row 1 serves both busy clusters better: 10 < 12.
    assert best_placement([[10, 0], [6, 6]], [1, 1]) == (1, [10.0, 12.0])


def test_ties_go_to_the_lowest_index():
    assert best_placement([[1, 2], [2, 1], [2, 1]], [1, 1])[0] == 0


@pytest.mark.parametrize("B,p,match", [
    ([[1, 2], [3]], [1, 1], "row 1 has 1 columns, throughput has 2"),
    ([], [1], "no rows"),
    ([[1]], [], "throughput is empty"),
    ([[1, -2]], [1, 1], r"bandwidth\[0\]\[1\].*-2"),
    ([[1, math.nan]], [1, 1], r"bandwidth\[0\]\[1\]"),
    ([[1, 1]], [1, math.inf], r"throughput\[1\]"),
    ([[1, "2"]], [1, 1], r"bandwidth\[0\]\[1\].*'2'"),
])
def test_bad_input_named(B, p, match):
    with pytest.raises(ValueError, match=match):
        placement_scores(B, p)


# ----- the `dips place` command ----------------------------------------------------------

def _run(tmp_path, b_text: str, p_text: str):
    from typer.testing import CliRunner

    from dips.cli import app

    (tmp_path / "B.csv").write_text(b_text)
    (tmp_path / "p.csv").write_text(p_text)
    return CliRunner().invoke(app, ["place", "--bandwidth", str(tmp_path / "B.csv"),
                                    "--throughput", str(tmp_path / "p.csv")])


def test_cli_prints_every_score_and_the_best(tmp_path):
    res = _run(tmp_path, "site,a,b,c\nsiteA,10,1,1\nsiteB,5,5,5\n# a comment\nsiteC,1,1,10\n",
               "cluster,tokens_per_s\na,1\nb,2\nc,3\n")
    assert res.exit_code == 0, res.output
    for name, score in (("siteA", "15"), ("siteB", "30"), ("siteC", "33")):
        assert any(name in line and score in line for line in res.output.splitlines())
    assert "i* = 2 (siteC), score 33" in res.output


def test_cli_plain_numbers(tmp_path):
    res = _run(tmp_path, "10,0\n6,6\n", "1,1\n")
    assert res.exit_code == 0, res.output
    assert "i* = 1 (1), score 12" in res.output


@pytest.mark.parametrize("b_text,p_text,match", [
    ("1,2\n3,x\n", "1,1\n", r"B.csv row 2, column 2: 'x' is not a finite number"),
    ("1,2\n3\n", "1,1\n", r"B.csv row 2 has 1 bandwidths, the first data row has 2"),
    ("1,2\n3,4\n", "1\n2\n3\n", r"p.csv has 3 throughputs but .*B.csv has 2 cluster columns"),
    ("1,2\n", "1,-1\n", r"p.csv row 1, column 2: '-1'"),
    ("# only a comment\n", "1\n", r"B.csv: no data rows"),
    ("1,2\n", "1,2\n3,4\n", r"p.csv row 1 has 2 values"),
])
def test_cli_refuses_bad_files_naming_row_and_column(tmp_path, b_text, p_text, match):
    import re

    res = _run(tmp_path, b_text, p_text)
    assert res.exit_code == 2
    assert re.search(match, res.output.replace("\n", "")), res.output
