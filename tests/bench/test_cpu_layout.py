"""A run over vLLM places its engines' compute on cores of their own (``--cpu-layout`` or the
split of the cores available); one that cannot is refused in one line, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cli import main as cli_main
from serving import cpus


def test_a_run_over_vllm_that_cannot_place_its_engines_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(cpus, "available_cores", lambda: (0, 1))
    argv = ["run", "--engine", "vllm", "--engine-option", f"model={tmp_path}",
            "--scale", "smoke", "--profiles", "a", "--stacks", "zerolayer,vllm-serve",
            "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("zl-bench: error: 2 vLLM engine replicas need 3 cores")
    with pytest.raises(SystemExit):
        cli_main(["run", "--engine", "sim", "--cpu-layout", "1/0", "--out", str(tmp_path)])
    assert "--cpu-layout places vLLM's engines" in capsys.readouterr().err
