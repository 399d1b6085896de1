"""``Report``: truthiness, the failed names, the table, ``raise_if_failed``."""

from __future__ import annotations

import pytest

from rlops.testing import Check, ContractError, Report

CHECKS = [
    Check("values", True, 1e-7, "error 1e-07 / bound 2e-07", "the maths is wrong"),
    Check("dones", None, None, "skipped: the function takes no dones=", "leaks"),
    Check("edges", False, 3.0, "gamma=0: error 3", "log 0 in a log-space scan"),
]


def test_a_failed_check_makes_the_report_false_and_names_it():
    report = Report("check_advantages(f)", CHECKS)
    assert not report and not report.ok
    assert report.failed == ["edges"]
    assert report["dones"].status == "skip" and report["values"].status == "ok"
    with pytest.raises(KeyError, match="values"):
        report["nope"]


def test_the_table_has_a_row_per_check_and_explains_the_failures():
    text = str(Report("check_advantages(f)", CHECKS))
    lines = text.splitlines()
    assert lines[0] == "check_advantages(f)"
    assert lines[1].split() == ["check", "result", "measured"]
    rows = {line.split()[0]: line.split()[1] for line in lines[3:6]}
    assert rows == {"values": "ok", "dones": "skip", "edges": "FAIL"}
    assert "1 failed (3 checks)" in text
    assert "  edges: log 0 in a log-space scan" in text
    assert "the maths is wrong" not in text  # passed checks need no explanation


def test_raise_if_failed_raises_an_assertion_error_with_the_table():
    with pytest.raises(ContractError, match="edges") as err:
        Report("t", CHECKS).raise_if_failed()
    assert isinstance(err.value, AssertionError)
    Report("t", CHECKS[:2]).raise_if_failed()  # a skipped check is not a failure
    assert Report("t", CHECKS[:2])
