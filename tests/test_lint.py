"""The lint gate as tests, so ``nox -s tests`` (what CI runs) holds the code to it: ruff's rules
and format, the import contracts (the layers and no cycles) and mypy. ``nox -s lint`` runs only
these."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# mypy checks the whole tree from a cold cache in about a minute on two cores
LIMIT_S = 600

GATES = {
    "ruff-check": ["ruff", "check", "."],
    "ruff-format": ["ruff", "format", "--check", "."],
    "import-contracts": ["lint-imports"],
    "mypy": ["mypy"],
}


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.parametrize("gate", GATES)
def test_the_tree_passes(gate: str) -> None:
    tool, *args = GATES[gate]
    proc = subprocess.run(
        [str(BIN / tool), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(GATES[gate])}:\n{proc.stdout[-6000:]}{proc.stderr}"
