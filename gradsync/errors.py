"""Error types. A :class:`UserError` is bad input: the CLI prints its one line and exits 2."""

from __future__ import annotations


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
    killed by SIGKILL``), for reports that show one line per failed job.
    """

    def __init__(self, message: str, exit_code: int = 1, *, cause: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.cause = cause
