"""How a run ends: complete, stopped by SIGINT or SIGTERM (keeping what it measured, with the
shell's exit status for it), or by an error; run.json records which."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from harness.runner.results import RunDir
from harness.schema import RunEnd

EXIT_INTERRUPTED: Final = 130
EXIT_TERMINATED: Final = 143
EXIT_STATUS: Final = {RunEnd.SIGINT: EXIT_INTERRUPTED, RunEnd.SIGTERM: EXIT_TERMINATED}


class Stopped(KeyboardInterrupt):
    """A signal a library caught on its way and returned from (Chaos Toolkit does, mid-
    experiment), raised again so that the run stops as at a signal anywhere else;
    ``terminated`` when it was SIGTERM, which that library's own handler took."""

    def __init__(self, message: str, terminated: bool) -> None:
        super().__init__(message)
        self.terminated = terminated


@dataclass
class Ending:
    """How the block under ``until_stopped`` ended."""

    end: RunEnd = RunEnd.COMPLETE

    @property
    def stopped(self) -> bool:
        """Whether a signal stopped it."""
        return self.end in EXIT_STATUS

    @property
    def status(self) -> int:
        """The exit status: 0, or the shell's for the signal that stopped it."""
        return EXIT_STATUS.get(self.end, 0)

    @property
    def verb(self) -> str:
        return "stopped" if self.end is RunEnd.SIGTERM else "interrupted"

    @property
    def detail(self) -> str:
        """``interrupted by SIGINT``, ``stopped by SIGTERM``: run.json's ``end_detail``."""
        return f"{self.verb} by {self.end.value.upper()}"


@contextlib.contextmanager
def stop_signals(seen: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM both stop the run cleanly: its stacks are stopped and what it measured
    is kept. SIGINT gets Python's own handler even where it was inherited ignored (a shell starts
    background jobs so); SIGTERM (whose default would leave the stacks running) is noted in
    ``seen`` and turned into SIGINT, which asyncio's runner and the loaders handle."""

    def on_sigterm(signum: int, frame: object) -> None:
        seen.append(signum)
        signal.raise_signal(signal.SIGINT)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def until_stopped(run: RunDir) -> Iterator[Ending]:
    """The block under ``stop_signals``, its end recorded in run.json. A signal ends the block
    and goes no further (the ``Ending`` says which it was); an error is recorded and raised."""
    ending, terminated = Ending(), list[int]()
    try:
        with stop_signals(terminated):
            yield ending
        run.finish(RunEnd.COMPLETE)
    except KeyboardInterrupt as exc:
        by_sigterm = bool(terminated) or (isinstance(exc, Stopped) and exc.terminated)
        ending.end = RunEnd.SIGTERM if by_sigterm else RunEnd.SIGINT
        run.finish(ending.end, ending.detail)
    except BaseException as exc:
        run.finish(RunEnd.ERROR, f"{type(exc).__name__}: {exc}")
        raise
