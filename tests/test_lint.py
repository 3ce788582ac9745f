"""The lint gate as tests, so ``nox -s tests`` (what CI runs) holds the code to it: ruff's rules
and format, the import contracts (the layers and no cycles) and mypy. ``nox -s lint`` runs only
these."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

BIN = Path(sys.executable).parent
# A hang guard: mypy checks the whole tree from a cold cache in about 16 s alone on two cores
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


PACKAGES = ("serving", "zerolayer", "baselines", "harness", "chaos", "bench")
# (module, the import added to it, the contract it breaks)
FORBIDDEN_IMPORTS = [
    ("baselines/rayserve/ingress.py", "import zerolayer.server", "one direction"),
    ("baselines/rayserve_llm/config.py", "import zerolayer.client", "one direction"),
    ("zerolayer/server/core.py", "import baselines.rayserve", "one direction"),
    ("serving/wire/contract.py", "import zerolayer", "one direction"),
    ("serving/engine/sim.py", "import baselines", "one direction"),
    ("serving/auth.py", "import harness", "one direction"),
    ("zerolayer/client/sdk.py", "import serving.engine", "the SDK is importable"),
]


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.parametrize(("module", "line", "contract"), FORBIDDEN_IMPORTS)
def test_the_contracts_refuse_an_import_against_the_layers(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    """A copy of the tree with one forbidden import added fails ``lint-imports``, naming the
    contract it breaks: the contracts can fail, and say which floor was crossed."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(f"{target.read_text()}\n{line}  # noqa: E402\n")
    proc = subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken = [ln for ln in proc.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), proc.stdout[-3000:]


MAX_MODULE_LINES = 600  # bench/, harness/, chaos/: a module with one job stays readable in one go
MAX_FUNCTION_LINES = 60


def test_every_module_of_the_upper_floors_and_every_function_stays_small() -> None:
    """The sizes the house keeps: no module over 600 lines in bench/, harness/ or chaos/, no
    function over 60 lines in any package (so a helper's job is named, not buried)."""
    long_modules = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in ("bench", "harness", "chaos")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    long_functions = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long_modules and not long_functions, long_modules + long_functions
