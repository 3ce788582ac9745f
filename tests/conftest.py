"""What every test shares: hypothesis without its per-example deadline, and the second tiny
model the real-vLLM tests run on (``short_model``, built once a session).

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
