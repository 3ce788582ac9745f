"""Sessions: ``tests`` (the CI suite), ``lint``, ``bench`` (the main job), ``benchmarks``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True
PYTHON = "3.11"


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite; arguments go to pytest."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-q", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install("ruff>=0.6,<1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The main job: drive the sim engine with profile A's request shape and check its fidelity."""
    session.install("-e", ".")
    session.run("python", "-m", "bench.fidelity", *session.posargs)


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    """pytest-benchmark micro-benchmarks (CPU cost of the hot paths); not part of ``tests``."""
    session.install("-e", ".[dev]")
    session.run("pytest", "benchmarks", "--benchmark-only", "-p", "no:randomly", *session.posargs)
