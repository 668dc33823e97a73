"""What `gradsync timeline summarize` writes beside a trace belongs to the run's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.errors import UserError
from gradsync.rundir import claim_run_dir


def _run_with_trace(folder: Path, trace: str) -> None:
    (folder / "metrics").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / trace).write_text('{"traceEvents": []}')


def test_overwrite_clears_a_runs_timeline_summary_and_gantt_chart(tmp_path: Path) -> None:
    """Probe 30b: `train --out R --overwrite` after `timeline summarize R/trace.json` was
    refused: 'holds trace.gantt.png, trace.summary.json, which gradsync did not write'."""
    run = tmp_path / "R"
    _run_with_trace(run, "trace.json")
    for name in ("trace.summary.json", "trace.gantt.png", ".trace.summary.json.x1.tmp"):
        (run / name).write_text("written by gradsync timeline summarize")
    claim_run_dir(run, overwrite=True)
    assert list(run.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["budget.summary.json", "budget.gantt.png", ".budget.summary.json.x1.tmp"]
)
@pytest.mark.parametrize("beside", [None, '{"limit": 3}'])
def test_overwrite_refuses_a_summary_beside_no_trace(
    name: str, beside: str | None, tmp_path: Path
) -> None:
    """Was cleared: any X.summary.json or X.gantt.png counted as gradsync's, so a user's
    budget.summary.json went with the run (while budget.json beside it was refused). Only
    the summary of a trace X.json lying beside it is gradsync's."""
    run = tmp_path / "R"
    _run_with_trace(run, "trace.json")
    (run / name).write_text("mine")
    if beside is not None:
        (run / "budget.json").write_text(beside)
    with pytest.raises(UserError, match=rf"holds .*{name.replace('.', '[.]')}.*which gradsync"):
        claim_run_dir(run, overwrite=True)
    assert (run / name).read_text() == "mine"


def test_overwrite_still_refuses_a_file_gradsync_did_not_write(tmp_path: Path) -> None:
    run = tmp_path / "R"
    _run_with_trace(run, "trace.json")
    (run / "notes.json").write_text("mine")
    (run / ".gantt.png").write_text("mine too")
    with pytest.raises(UserError, match=r"holds \.gantt\.png, notes\.json, which gradsync"):
        claim_run_dir(run, overwrite=True)
    assert (run / "notes.json").exists()
