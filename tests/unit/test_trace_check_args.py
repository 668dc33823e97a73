"""`gradsync timeline summarize` on hand-edited span args: one line, not a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradsync.errors import UserError
from gradsync.trace_check import check_events


def _events(args: Any) -> list[dict[str, Any]]:
    """One step on rank 0 with an ALLREDUCE span carrying ``args`` on a channel track."""
    return [
        {"ph": "B", "name": "STEP", "pid": 0, "tid": 0, "ts": 0, "args": {"step": 0}},
        {"ph": "B", "name": "ALLREDUCE", "pid": 0, "tid": 1, "ts": 1, "args": args},
        {"ph": "E", "name": "ALLREDUCE", "pid": 0, "tid": 1, "ts": 2},
        {"ph": "E", "name": "STEP", "pid": 0, "tid": 0, "ts": 3},
    ]


def test_well_typed_args_pass() -> None:
    args = {"step": 0, "tensor": "bucket0", "bytes": 4096}
    assert check_events(Path("t.json"), _events(args)) == [0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # probe 30b: a ValueError and a TypeError (unhashable list) in the summary
        ({"bytes": "lots"}, "event 1 (B ALLREDUCE) has args.bytes 'lots', not a whole number"),
        ({"tensor": ["x"]}, "has args.tensor ['x'], not a string"),
        ({"bytes": -1}, "has args.bytes -1, not a whole number >= 0"),
        ({"step": [1]}, "has args.step [1], not a whole number"),
        ([1], "has args [1], not an object"),
    ],
)
def test_badly_typed_args_are_one_line(args: Any, message: str) -> None:
    with pytest.raises(UserError, match=r"^t\.json: .*write the trace again") as raised:
        check_events(Path("t.json"), _events(args))
    assert message in str(raised.value) and "\n" not in str(raised.value)
