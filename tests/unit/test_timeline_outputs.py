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


@pytest.mark.parametrize("trace", ["trace.json", "step10-20.json"])
def test_overwrite_clears_a_runs_timeline_summary_and_gantt_chart(
    trace: str, tmp_path: Path
) -> None:
    """Probe 30b: `train --out R --overwrite` after `timeline summarize R/trace.json` was
    refused: 'holds trace.gantt.png, trace.summary.json, which gradsync did not write'."""
    run = tmp_path / "R"
    _run_with_trace(run, "trace.json")
    stem = Path(trace).stem
    for name in (f"{stem}.summary.json", f"{stem}.gantt.png", f".{stem}.summary.json.x1.tmp"):
        (run / name).write_text("written by gradsync timeline summarize")
    claim_run_dir(run, overwrite=True)
    assert list(run.iterdir()) == []


def test_overwrite_still_refuses_a_file_gradsync_did_not_write(tmp_path: Path) -> None:
    run = tmp_path / "R"
    _run_with_trace(run, "trace.json")
    (run / "notes.json").write_text("mine")
    (run / ".gantt.png").write_text("mine too")
    with pytest.raises(UserError, match=r"holds \.gantt\.png, notes\.json, which gradsync"):
        claim_run_dir(run, overwrite=True)
    assert (run / "notes.json").exists()
