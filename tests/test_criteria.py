"""The registry of criteria: every list of criteria is derived from it, named subsets are checked
against it, and the command line's help names what it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ggufcarve.cli import app
from ggufcarve.errors import BadInput
from ggufcarve.select.criteria import (
    ALL_METHODS,
    BEST_DEFAULT,
    CRITERIA,
    IMATRIX_METHODS,
    PASS_METHODS,
    READS,
    SUPER_EXPERT_METHODS,
    TRACE_METHODS,
    ZERO_SHOT,
    criterion_named,
    markdown_table,
    subset,
)


def test_every_criterion_is_described_and_reads_a_known_input():
    for name, c in CRITERIA.items():
        assert c.name == name and c.reads in READS and c.summary and c.source
        assert c.needs in ("model", "imatrix", "calibration")
        assert not c.super_experts or c.records_outputs, name  # the maxima are taken from the outputs


def test_the_lists_partition_the_registry():
    groups = (ZERO_SHOT, IMATRIX_METHODS, TRACE_METHODS)
    assert sorted(m for g in groups for m in g) == sorted(CRITERIA)
    assert set(PASS_METHODS) < set(TRACE_METHODS) and set(SUPER_EXPERT_METHODS) <= set(TRACE_METHODS)
    assert all(CRITERIA[m].needs == "model" for m in ZERO_SHOT)
    assert all(CRITERIA[m].needs == "calibration" for m in TRACE_METHODS)


def test_all_is_every_criterion_but_the_razor_pass_with_greedy_last():
    assert set(ALL_METHODS) == {m for m, c in CRITERIA.items() if c.reads != "razor pass"}
    assert len(ALL_METHODS) == len(set(ALL_METHODS)) and ALL_METHODS[-1] == "greedy"


def test_named_subsets_are_criteria_of_the_registry():
    from ggufcarve.best.plan import BestSettings
    from ggufcarve.pipeline.demo import TOURNAMENT

    for names in (BEST_DEFAULT, TOURNAMENT, BestSettings.__dataclass_fields__["methods"].default):
        assert names and all(n in CRITERIA for n in names), names


def test_a_subset_naming_an_unknown_criterion_is_refused():
    assert subset("reap", "weights") == ("reap", "weights")
    with pytest.raises(BadInput, match="unknown method 'reaper'") as err:
        subset("reap", "reaper")
    assert all(name in err.value.hint for name in CRITERIA)
    with pytest.raises(BadInput):
        criterion_named("")


def _help(*argv: str) -> str:
    result = CliRunner().invoke(app, [*argv, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    joined = re.sub(r"[\s│]+", " ", result.output)
    return re.sub(r"(?<=\w)- (?=\w)", "-", joined)  # click's wrapping breaks lines after a hyphen (router-|norm)


def test_select_help_names_every_criterion_and_tune_help_names_the_zero_shot_ones():
    text = _help("select")
    assert all(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) for name in CRITERIA), text
    tune = _help("tune")
    assert all(name in tune for name in ZERO_SHOT)
    assert ",".join(BEST_DEFAULT) in _help("best")


def test_the_criteria_page_holds_the_registry_table():
    page = (Path(__file__).resolve().parent.parent / "docs" / "criteria.md").read_text(encoding="utf-8")
    assert markdown_table() in page, (
        "docs/criteria.md: paste markdown_table() of ggufcarve.select.criteria over its table"
    )


def test_the_table_has_one_row_per_criterion_with_escaped_bars():
    rows = markdown_table().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == list(CRITERIA)
    assert all(row.count(" | ") == 5 for row in rows)  # no unescaped | inside a cell
