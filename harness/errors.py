"""Errors that cross the harness/bench boundary."""


class UsageError(Exception):
    """A user's mistake: the CLI prints one error line and exits 2."""
