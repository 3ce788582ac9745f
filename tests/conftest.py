"""What every test shares: hypothesis without its per-example deadline, the second tiny model the
real-vLLM tests run on (``short_model``, built once a session), the order of the files, and,
where ``ZL_TEST_CPU_DIR`` names a directory (CI sets it), each test's CPU time beside its wall time.

The machines tests run on are shared and noisy (two cores, other work beside), so a fixed 200 ms
allowance per example measures the host, not the code: a property test fails on a wrong answer,
never on a slow one (pytest-timeout still bounds a test that hangs).
"""

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from hypothesis import settings
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

from tests.support.models import write_short_model

settings.register_profile("zl-bench", deadline=None)
settings.load_profile("zl-bench")


@pytest.fixture(scope="session")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests.support.models``' short model, built offline once per session."""
    pytest.importorskip("tokenizers", reason="the tiny models need tokenizers (nox -s vllm)")
    return write_short_model(tmp_path_factory.mktemp("short-model") / "tiny-2k")


ALONE: Final = ("tests/bench/test_readme_bench.py",)
"""Files whose worker runs nothing else: the README's run waits for minutes at a fifth of a core,
and a file queued behind it on its worker (pytest-xdist queues two) would finish last, with the
other workers idle."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`ALONE` first, then those that hold a ``slow`` test, the rest in their
    usual order: the test session hands whole files to its workers in this order (noxfile.py), so
    a file of minutes starts at once instead of last, when nothing is left to run beside it."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: (item.nodeid.split("::")[0] not in ALONE, item.path not in slow_files)
    )


class LoadFileAlone(LoadFileScheduling):
    """pytest-xdist's whole-file scheduling, except that a worker given a file of :data:`ALONE`
    is told to stop after it, where another worker is left for the rest (a worker runs its last
    test only once it has a next one or that word: it cannot simply be left without more)."""

    def _reschedule(self, node: WorkerController) -> None:
        alone = set(self.assigned_work.get(node, {})) & set(ALONE)
        if alone and len(self.nodes) > 1 and not node.shutting_down:
            node.shutdown()
            return
        super()._reschedule(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileAlone | None:
    """:class:`LoadFileAlone` for ``--dist=loadfile`` (the test sessions'), xdist's own else."""
    return LoadFileAlone(config, log) if config.getvalue("dist") == "loadfile" else None


CPU_DIR = os.environ.get("ZL_TEST_CPU_DIR")


def _cpu_s() -> float:
    """CPU seconds of this process and of the processes it has waited for (a CLI a test ran,
    a Ray that a stand-up started and stopped), user and system."""
    own, waited = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """One line per test (setup, call and teardown: a module fixture is counted where it is set up
    and torn down) in ``ZL_TEST_CPU_DIR``, one file per worker: what a test costs the cores, which
    its wall time on a shared host does not say (.ci/sessions.py prints the most costly)."""
    if not CPU_DIR:
        yield
        return
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2)}
    line["wall_s"] = round(time.monotonic() - wall, 2)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(CPU_DIR).mkdir(parents=True, exist_ok=True)
    with (Path(CPU_DIR) / f"{worker}-{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
