"""Progress display: a bar on a terminal, plain log lines otherwise (rank 0 only)."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gradsync.metrics import StepRecord


class StepProgress:
    """Shows step, rank 0's shard loss and samples/s as training goes.

    Example:
        >>> with StepProgress(10, enabled=False) as progress:
        ...     pass
    """

    def __init__(self, total_steps: int, *, enabled: bool, log_every: int | None = None) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.log_every = log_every or max(1, total_steps // 10)
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.enabled and sys.stdout.isatty():
            self._bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total_steps, status="")
        return self

    def update(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        # rank 0's own shard; the summary's loss is the mean over the workers
        status = f"shard loss {record.loss:.4f}  {record.samples_per_s:,.1f} samples/s"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, status=status)  # type: ignore[arg-type]
        elif (record.step + 1) % self.log_every == 0 or record.step + 1 == self.total_steps:
            print(f"[rank 0] step {record.step + 1}/{self.total_steps}  {status}", flush=True)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, error, trace)
