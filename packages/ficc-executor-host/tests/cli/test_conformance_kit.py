"""The conformance kit's parts that need no provider: its rule names, as documented,
and its report. Runs against real providers: tests-integration/test_conformance.py."""

from __future__ import annotations

import json
import pathlib

import pytest

from ficc.execution.host import conformance
from ficc.execution.host.cli.conformance import RULES, Outcome

DOC = pathlib.Path(__file__).parents[4] / "docs" / "providers.md"


def test_the_documented_rules_are_the_kits() -> None:
    if not DOC.exists():
        pytest.skip(f"{DOC} is not part of this tree (an sdist has no docs/)")
    body = DOC.read_text().split("<!-- conformance-rules -->")[1]
    body = body.split("<!-- /conformance-rules -->")[0]
    rows = [line for line in body.strip().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(RULES)


def test_a_report_names_the_broken_rule_and_counts() -> None:
    outcomes = [
        Outcome("probe.accepts", True),
        Outcome("release.repeatable", False, "release refused the row: not_prepared: gone"),
        Outcome("stop.running", False, "not run: the run stopped", skipped=True),
    ]
    lines = list(conformance._report(outcomes, as_json=False))
    assert lines == [
        "pass  probe.accepts",
        "FAIL  release.repeatable: release refused the row: not_prepared: gone",
        "SKIP  stop.running: not run: the run stopped",
        "1 passed, 1 failed, 1 skipped",
    ]
    (document,) = conformance._report(outcomes, as_json=True)
    assert json.loads(document)[1:] == [
        {
            "rule": "release.repeatable",
            "passed": False,
            "message": "release refused the row: not_prepared: gone",
            "skipped": False,
        },
        {
            "rule": "stop.running",
            "passed": False,
            "message": "not run: the run stopped",
            "skipped": True,
        },
    ]


def test_a_configuration_that_cannot_be_read_cannot_run(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "absent.json")
    argv = ["--config", missing, "--provider", "test", "--plan", missing]
    assert conformance.main(argv) == 2
    assert capsys.readouterr().err.startswith("conformance: cannot run: ")


def test_the_command_has_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as exited:
            conformance.main([flag])
        assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--unpinned" in out
    assert out.rstrip().splitlines()[-1].startswith("ficc-executor ")
