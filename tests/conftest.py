"""What every test shares: hypothesis without its per-example deadline, the second tiny model the
real-vLLM tests run on (``short_model``, built once a session), and the order of the files.

The machines tests run on are shared and noisy (two cores, other work beside), so a fixed 200 ms
allowance per example measures the host, not the code: a property test fails on a wrong answer,
never on a slow one (pytest-timeout still bounds a test that hangs).
"""

from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.models import write_short_model

settings.register_profile("zl-bench", deadline=None)
settings.load_profile("zl-bench")


@pytest.fixture(scope="session")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests.support.models``' short model, built offline once per session."""
    pytest.importorskip("tokenizers", reason="the tiny models need tokenizers (nox -s vllm)")
    return write_short_model(tmp_path_factory.mktemp("short-model") / "tiny-2k")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files that hold a ``slow`` test first, the rest in their usual order: the test session
    hands whole files to its workers in this order (noxfile.py), so a file of minutes starts at
    once instead of last, when nothing is left to run beside it."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
