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
    """A distributed job ended badly (a rank died or exited non-zero)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
