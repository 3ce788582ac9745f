"""Command-line pieces shared by every command line (``zl-replica``, ``zl-baseline``, ``zl-bench``).

A user's mistake on a command line gets one ``PROG: error: ...`` line and exit status 2, never a
usage dump or a traceback; help shows every default.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

MAX_PORT = 65535
N = TypeVar("N", int, float)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except empty ones (unset, no repeats), which say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, and whose help shows defaults."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> int:
    """Print ``PROG: error: message`` (first line only) and return the usage-error status, 2."""
    print(f"{prog}: error: {message.splitlines()[0] if message else 'failed'}", file=sys.stderr)
    return 2


def _parse(text: str, kind: Callable[[str], N], expected: str) -> N:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def port(text: str) -> int:
    """A TCP port to listen on: 0 (any free port) to 65535; never wrapped or negative."""
    value = _parse(text, int, "a port number")
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"port must be 0..{MAX_PORT} (0: any free port), got {value}"
        )
    return value


def positive_int(text: str) -> int:
    value = _parse(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not (value > 0 and math.isfinite(value)):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def open_fraction(text: str) -> float:
    value = _parse(text, float, "a number")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def readable_file(text: str) -> str:
    """A path to an existing, readable file (certificates, keys)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text}")
    return text
