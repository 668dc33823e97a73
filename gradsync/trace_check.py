"""Checks of a Chrome trace before ``gradsync timeline summarize`` reads it.

A trace edited by hand, cut short by a killed job or written by another tool can have an
``E`` without its ``B``, a ``B`` never closed, or events without ``pid``/``tid``/``ts``.
Each is one line naming the trace, the event and how to fix it (exit 2), found before any
summary or chart is written; so is a ``--step`` the trace does not record.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from gradsync.errors import UserError
from gradsync.rundir import check_writable
from gradsync.trace import Phase

SPAN_PHASES = ("B", "E", "X")
_FIX = "write the trace again with gradsync train --timeline PATH"


def check_events(path: Path, events: list[Any]) -> list[int]:
    """UserError on a malformed event or an unmatched B/E; the steps the trace records.

    Example:
        >>> events = [{"ph": "B", "name": "STEP", "pid": 0, "tid": 0, "ts": 0, "args": {"step": 3}},
        ...           {"ph": "E", "pid": 0, "tid": 0, "ts": 5}]
        >>> check_events(Path("t.json"), events)
        [3]
        >>> check_events(Path("t.json"), events[1:])
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: t.json: event 0 (E on pid 0, tid 0) ends a span that never ...
    """
    open_spans: dict[tuple[Any, Any], list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    steps: set[int] = set()
    for index, event in enumerate(events):
        if not isinstance(event, dict) or event.get("ph") not in (*SPAN_PHASES, "M", "i", "C"):
            raise UserError(f"{path}: event {index} is not a trace event ({event!r:.60}); {_FIX}")
        if event["ph"] == "M":
            _check_metadata(path, index, event)
        if event["ph"] not in SPAN_PHASES:
            continue
        for key in ("pid", "tid", "ts"):
            if not _finite_number(event.get(key)):
                raise UserError(
                    f"{path}: event {index} ({event['ph']} {event.get('name', '?')}) has no "
                    f"finite numeric {key}; {_FIX}"
                )
        track = (event["pid"], event["tid"])
        where = f"{event['ph']} on pid {track[0]}, tid {track[1]}"
        if event["ph"] != "E" and not isinstance(event.get("name"), str):
            raise UserError(f"{path}: event {index} ({where}) has no name; {_FIX}")
        if event["ph"] != "E":
            _check_span_args(path, index, event)
        if event["ph"] == "B":
            open_spans[track].append((index, event))
        elif event["ph"] == "E":
            if not open_spans[track]:
                raise UserError(
                    f"{path}: event {index} ({where}) ends a span that never began; {_FIX}"
                )
            begun, begin = open_spans[track].pop()
            if event["ts"] < begin["ts"]:
                raise UserError(
                    f"{path}: event {index} ({where}) ends the span of event {begun} "
                    f"({begin['name']}) before it began (ts {event['ts']} < {begin['ts']}); {_FIX}"
                )
            if begin["name"] == Phase.STEP and track[1] == 0:
                steps.add(_step_number(path, begun, begin))
    for track, unclosed in open_spans.items():
        if unclosed:
            index, event = unclosed[-1]
            raise UserError(
                f"{path}: event {index} (B {event.get('name', '?')} on pid {track[0]}, tid "
                f"{track[1]}) is never ended (a job killed while tracing?); {_FIX}"
            )
    return sorted(steps)


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What the summary reads from a span's args, and what each must be.
SPAN_ARGS = {
    "step": ("a whole number", _whole),
    "bytes": ("a whole number >= 0", lambda v: _whole(v) and v >= 0),
    "tensor": ("a string", lambda v: isinstance(v, str)),
}


def _check_span_args(path: Path, index: int, event: dict[str, Any]) -> None:
    """A span's ``args`` is an object, and its ``step``, ``bytes`` and ``tensor`` (when
    there) have the types the summary reads (a hand-edited ``bytes = "lots"`` would be a
    ValueError there, a list ``tensor`` a TypeError).

    Example:
        >>> span = {"ph": "B", "name": "PUSH", "pid": 0, "tid": 1, "ts": 0,
        ...         "args": {"bytes": "lots"}}
        >>> _check_span_args(Path("t.json"), 4, span)
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: t.json: event 4 (B PUSH) has args.bytes 'lots', not a whole ...
    """
    args = event.get("args", {})
    where = f"{path}: event {index} ({event['ph']} {event['name']})"
    if not isinstance(args, dict):
        raise UserError(f"{where} has args {args!r:.40}, not an object; {_FIX}")
    for key, (kind, valid) in SPAN_ARGS.items():
        if key in args and not valid(args[key]):
            raise UserError(f"{where} has args.{key} {args[key]!r:.40}, not {kind}; {_FIX}")


def _check_metadata(path: Path, index: int, event: dict[str, Any]) -> None:
    """A metadata event names a process or thread: ``name`` and ``args.name`` are text."""
    args = event.get("args")
    if not isinstance(event.get("name"), str) or not isinstance(args, dict):
        raise UserError(f"{path}: event {index} (M) has no name or no args object; {_FIX}")


def _step_number(path: Path, index: int, begin: dict[str, Any]) -> int:
    """The step a STEP span records (its ``args.step``, a whole number)."""
    args = begin.get("args")
    number = args.get("step") if isinstance(args, dict) else None
    if not isinstance(number, int) or isinstance(number, bool):
        raise UserError(
            f"{path}: event {index} (B STEP) has no whole-number args.step (got {args!r:.40}); "
            f"{_FIX}"
        )
    return number


def check_trace(path: Path, step: int | None = None) -> None:
    """Check ``path`` (and that it records ``step``, when given) before summarizing it.

    Example:
        >>> # check_trace(Path("runs/a/trace.json"), step=12)
    """
    from gradsync.timeline_summary import load_trace

    trace = load_trace(path)
    if not isinstance(trace.get("otherData", {}), dict):
        raise UserError(f"{path}: otherData is not an object; {_FIX}")
    steps = check_events(path, trace["traceEvents"])
    if not steps:
        raise UserError(f"{path} records no steps; widen --timeline-steps")
    check_writable(path.parent, flag=f"the folder of {path}")
    for suffix in (".summary.json", ".gantt.png"):  # what summarizing writes beside it
        output = path.with_name(path.stem + suffix)
        if output.is_dir():
            raise UserError(
                f"{output} is a folder, where the summary of {path} is written; move it away"
            )
    if step is not None and step not in steps:
        recorded = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps"
        raise UserError(f"--step {step} is not in {path}, which records {recorded}; pick one")


__all__ = ["check_events", "check_trace"]
