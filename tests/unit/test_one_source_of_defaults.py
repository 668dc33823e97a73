"""One source of truth: the cut-short line both result logs finish before appending, and
predict's help texts, which show PREDICT_DEFAULTS rather than copies of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gradsync.files import end_line_cut_short, read_cell_records
from gradsync.predict import commands


def _predict_help() -> str:
    parser = argparse.ArgumentParser(prog="gradsync")
    commands.add_parsers(parser.add_subparsers(dest="command"))
    predict = parser._subparsers._group_actions[0].choices["predict"]  # type: ignore[union-attr]
    return " ".join(predict.format_help().split())


def test_predict_help_shows_the_defaults_it_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    """The help said 'default 25us', '(default 1)' beside PREDICT_DEFAULTS: a changed
    default would have left the help wrong."""
    changed = {"latency": "7us", "queue": "5ms", "ranks_per_host": 3, "compute_speedup": 2.5}
    monkeypatch.setattr(commands, "PREDICT_DEFAULTS", {**commands.PREDICT_DEFAULTS, **changed})
    text = _predict_help()
    for shown in ("(default 7us; 0 for none)", "(default 5ms: shallow", "link (default 3)",
                  "as measured (default 2.5)", "(default 1,2,4,8,16,32,64)"):  # fmt: skip
        assert shown in text


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, None), ("", ""), ('{"id": "a"}\n', '{"id": "a"}\n'), ('{"id": "a"}\n{"i', None)],
)
def test_a_line_cut_short_is_finished_once(
    before: str | None, after: str | None, tmp_path: Path
) -> None:
    log = tmp_path / "results.jsonl"
    if before is not None:
        log.write_text(before)
    end_line_cut_short(log)
    end_line_cut_short(log)
    if before is None:
        assert not log.exists()
    else:
        assert log.read_text() == (after if after is not None else before + "\n")


def test_a_validations_log_goes_on_after_a_line_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradsync.predict.validate import _append_cell

    log = tmp_path / "cells.jsonl"
    log.write_text(json.dumps({"id": "a"}) + '\n{"id": "b", "sta')
    _append_cell(log, {"id": "b"})
    assert [record["id"] for record in read_cell_records(log, missing="not run")] == ["a", "b"]
    assert capsys.readouterr().err.count("line 2 is not a complete record") == 1
