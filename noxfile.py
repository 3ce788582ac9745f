"""Sessions: ``bench`` (the main job), ``sweep`` (load curves), ``tests`` (what CI runs),
``tests-under-load`` (the tests beside two busy processes),
``lint`` (ruff, import contracts, mypy), ``vllm`` (the tests against the real CPU vLLM),
``chaos``, ``attack`` (the attack suite), ``benchmarks`` (pytest-benchmark), ``perf`` (the
replica's CPU per token against a stored baseline), ``overhead`` and ``fidelity``."""

from __future__ import annotations

import os
import subprocess
import sys

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True
PYTHON = "3.11"
# The CPU build of PyTorch this machine keeps on disk; a looser range pulls a multi-GB CUDA build.
TORCH_CPU = "torch==2.13.0"
# Test files spread over two workers per core, at most four (each may start a local Ray of its
# own), a file to a worker (its module fixtures set up once). The tests wait more than they
# compute (a quiet 2-core host was 56 % busy with one worker per core): two per core took the
# session from 684 s to 526 s there, at the same CPU. Files run in the order tests/conftest.py
# gives them, the slow ones first (pytest-xdist's own reorder puts the files with the most tests
# first, and the longest single test then starts last), and the README's run alone on its worker.
CORES = os.cpu_count() or 1
BY_FILE = ("--dist=loadfile", "--no-loadscope-reorder")
PARALLEL = (f"--numprocesses={min(4, 2 * CORES)}", *BY_FILE)
# The real-vLLM tests: one worker per core, at most two (each file starts engines of a few GB).
VLLM_PARALLEL = (f"--numprocesses={min(2, CORES)}", *BY_FILE)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Stand up both stacks, run the profiles, write results/<run-id>/ with report.html.

    Arguments after ``--`` go to ``zl-bench run`` (``--scale``, ``--profiles``, ``--stacks``,
    ``--engine``, ``--loader``, ``--out``, ``--zerolayer-urls``, ``--baseline-url``, ...).
    """
    session.install("-e", ".")
    session.run("zl-bench", "run", *session.posargs)


@nox.session(python=PYTHON)
def notebook(session: nox.Session) -> None:
    """Redraw a run's figures in notebooks/reproduce.ipynb: ``nox -s notebook -- results/<run-id>``
    (the newest run when none is given); the executed notebook and its HTML export are written
    into the run directory. ``nox -s notebook -- --notebook history`` runs
    notebooks/history.ipynb on the results store instead. Arguments after ``--`` go to
    ``zl-bench notebook``."""
    session.install("-e", ".")
    session.run("zl-bench", "notebook", *session.posargs)


@nox.session(python=PYTHON)
def sweep(session: nox.Session) -> None:
    """One profile at a series of offered rates on both stacks: load curves, max goodput under
    the profile's SLOs, the knee. Arguments after ``--`` go to ``zl-bench sweep``."""
    session.install("-e", ".")
    session.run("zl-bench", "sweep", *session.posargs)


def _install_dev(session: nox.Session) -> None:
    """The project, its test tools and the CPU torch: what the tests and the type checker see."""
    session.install("-e", ".[dev]", TORCH_CPU, "safetensors>=0.4,<1")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (CPU only; GPU tests skip with their reason); arguments go to pytest."""
    _install_dev(session)
    session.run("pytest", *PARALLEL, *session.posargs)


# tests-under-load: busy-loop processes beside the test session, each ending with the session
# (or, should nox itself be killed, when its parent goes or after BUSY_LIMIT_S).
BUSY_PROCESSES = 2
BUSY_LIMIT_S = 3 * 3600
BUSY_LOOP = (
    "import os, sys, time\n"
    "parent, end = os.getppid(), time.monotonic() + float(sys.argv[1])\n"
    "while os.getppid() == parent and time.monotonic() < end:\n"
    "    sum(range(100_000))\n"
)


@nox.session(python=PYTHON, name="tests-under-load")
def tests_under_load(session: nox.Session) -> None:
    """The test suite as ``tests`` runs it, with two busy processes beside it: a test that judges
    a wall-clock bound sized on a quiet host fails here. Not part of CI (it proves that no loaded
    host can fail CI); arguments go to pytest."""
    _install_dev(session)
    busy = [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(BUSY_LIMIT_S)])
        for _ in range(BUSY_PROCESSES)
    ]
    session.log(f"{BUSY_PROCESSES} busy processes beside the tests: {[p.pid for p in busy]}")
    try:
        session.run("pytest", *PARALLEL, *session.posargs)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


# PyPI's builds of these pull in against a different torch and fail to import beside the CPU
# torch (``operator torchvision::nms does not exist``), which breaks ``transformers`` and so vLLM.
_BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The tests against the real CPU vLLM (``-m vllm``); arguments go to pytest."""
    session.install("-e", ".[dev,vllm]", TORCH_CPU)
    # run_install: part of the install, so ``--install-only`` leaves a working venv too.
    session.run_install("python", "-m", "pip", "uninstall", "-y", *_BROKEN_BESIDE_CPU_TORCH)
    session.run(
        "pytest",
        "-m",
        "vllm",
        *VLLM_PARALLEL,
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, the import contracts (import-linter: the layers and no cycles) and mypy: the lint
    tests alone (``tests/test_lint.py``; ``nox -s tests`` runs them too, so CI does)."""
    _install_dev(session)
    session.run("pytest", "tests/test_lint.py", *session.posargs)


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """Every chaos experiment on both stacks; arguments go to ``zl-bench chaos``."""
    session.install("-e", ".")
    session.run("zl-bench", "chaos", *(session.posargs or ["--scale", "laptop"]))


@nox.session(python=PYTHON)
def attack(session: nox.Session) -> None:
    """The attack suite: each attack of issue 14 against a fresh replica beside a healthy client.
    Arguments go to ``zl-bench attack``: ``--only NAME``, ``--seconds``, ``--engine``, ``--out``.
    """
    session.install("-e", ".")
    session.run("zl-bench", "attack", *session.posargs)


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    """pytest-benchmark micro-benchmarks of the hot paths (sim step, client encode, ...)."""
    session.install("-e", ".[dev]")
    session.run("pytest", "benchmarks", "--benchmark-only", *session.posargs)


@nox.session(python=PYTHON)
def perf(session: nox.Session) -> None:
    """The replica's CPU per streamed token against a bare h2 echo's, measured in the same run,
    held to the stored baseline (benchmarks/perf_baseline.json); arguments go to pytest."""
    session.install("-e", ".[dev]")
    session.run("pytest", "benchmarks/test_perf.py", "-s", *session.posargs)


@nox.session(python=PYTHON)
def overhead(session: nox.Session) -> None:
    """What each stack adds over an in-process null engine; arguments go to zl-bench overhead."""
    session.install("-e", ".")
    session.run("zl-bench", "overhead", *session.posargs)


@nox.session(python=PYTHON)
def fidelity(session: nox.Session) -> None:
    """The sim engine against its step-time model: 256 concurrent requests, drift and CPU share."""
    session.install("-e", ".")
    session.run("zl-bench", "fidelity", *session.posargs)
