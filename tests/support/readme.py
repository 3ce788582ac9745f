"""The README's command lines as a newcomer copies them, so tests run what the README says."""

from __future__ import annotations

import re
import shlex

from tests.support.paths import ROOT

README = ROOT / "README.md"
NOTEBOOK_SECTION = "## Redraw a run's figures in the notebook"


def commands(section: str) -> list[str]:
    """The command lines of the first ``bash`` block under the heading ``section``, each without
    its trailing comment."""
    text = README.read_text()
    start = text.index(section + "\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.DOTALL)
    assert block is not None, f"no bash block under {section!r} in {README}"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def zl_bench_args(line: str) -> list[str]:
    """What a ``nox -s <session> -- ARGS`` line hands to ``zl-bench``: ARGS."""
    words = shlex.split(line.split("&&")[-1])
    return words[words.index("--") + 1 :]
