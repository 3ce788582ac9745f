"""Errors that cross the harness/bench boundary."""


class UsageError(Exception):
    """A user's mistake: the CLI prints one error line and exits 2."""


class StartFailed(UsageError):
    """A part of a stack exited (or never answered) at start. Reported like a user's mistake,
    one line naming the part, the reason its log gives and the log, since the reason is nearly
    always its configuration (a model, an engine option)."""

    def __init__(self, what: str, reason: str, log: object) -> None:
        super().__init__(f"{what} did not start: {reason} (log: {log})")
        self.what, self.reason, self.log = what, reason, log


class ClusterError(Exception):
    """The Ray cluster a run is placed on failed it (a node it used was lost): the run stops
    with what it measured saved, and the CLI prints one error line and exits 1."""
