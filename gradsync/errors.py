"""Error types. A :class:`UserError` is bad input: the CLI prints its one line and exits 2."""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user: one line saying what, why and how to fix it.

    Example:
        >>> raise UserError("unknown model 'resnet'; choose one of: mnist-cnn, resnet56")
        Traceback (most recent call last):
        ...
        gradsync.errors.UserError: unknown model 'resnet'; choose one of: mnist-cnn, resnet56
    """


class JobFailed(Exception):
    """A distributed job ended badly (a rank died, hung or exited non-zero).

    ``cause`` is one line naming the rank that caused it (``rank 1 (worker, pid 7) was
    killed by SIGKILL``), for reports that show one line per failed job. ``final``: a rank
    ended the run itself (a loss that is not finite), which a restart from the last
    checkpoint would only reach again.
    """

    def __init__(
        self, message: str, exit_code: int = 1, *, cause: str | None = None, final: bool = False
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.cause = cause
        self.final = final


def one_line(error: Exception) -> str:
    """The most telling line of a job's failure: the rank that caused it (when the launcher
    named one), then the last line that names an error.

    Example:
        >>> one_line(JobFailed("rank 1 failed; its last stderr lines:\\n  x\\n  ValueError: bad"))
        'ValueError: bad'
        >>> one_line(JobFailed("…\\n  ValueError: bad", cause="rank 1 (worker) exited with code 1"))
        'rank 1 (worker) exited with code 1: ValueError: bad'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    telling = [line for line in lines if "error" in line.lower()]
    line = (telling or lines or [type(error).__name__])[-1].removeprefix("gradsync: error: ")
    cause = getattr(error, "cause", None)
    if cause and not line.startswith(cause):
        line = f"{cause}: {line}" if cause not in line else line
    return line[:240]


def say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of one job (under torchrun, say) share a
    terminal, and a message and its newline written apart ran two ranks' lines together.

    Example:
        >>> say("gradsync: error: an example")  # doctest: +SKIP
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
