"""``zl-bench run`` on a model unlike ``zl-bench tiny-model``'s (2,048 positions, 1,024 tokens:
the session's ``short_model``), not told its limits: it completes at smoke scale and says what
it fitted (``max_model_len`` the model's own, profile C's large prompts clamped inside it); a
request that cannot fit is refused in one line before anything starts; and a configuration vLLM
itself refuses reaches the user as one line with vLLM's reason and the replica's log.
``calibrate``, ``fidelity`` and ``overhead`` run on the same model in their own vLLM tests
(``test_fidelity_vllm.py``, ``test_overhead_vllm.py``).

Real CPU vLLM (``nox -s vllm``), kept short: one engine start that serves, one that vLLM
refuses (about 100 s on two cores). Skips, with the reason, where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench.cli import main
from tests.support.models import SHORT_MODEL_CONTEXT

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

FITTED = f"max_model_len {SHORT_MODEL_CONTEXT} (the model's context)"
CLAMPED = "c_mixed class large: 8000 B -> "


def _model(short_model: Path) -> list[str]:
    return ["--engine-option", f"model={short_model}"]


def test_an_overhead_request_that_cannot_fit_is_refused_before_vllm_starts(
    short_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["overhead", "--engine", "vllm", *_model(short_model), "--prompt-bytes", "40000"]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1, err
    assert f"with --max-tokens 32 that passes max_model_len {SHORT_MODEL_CONTEXT}" in err


def test_run_fits_the_model_and_every_request_completes(
    short_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--engine", "vllm", *_model(short_model), "--stacks", "zerolayer"]
    argv += ["--profiles", "c", "--scale", "smoke", "--repeats", "1", "--replicas", "1"]
    assert main([*argv, "--quiet", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert FITTED in printed and CLAMPED in printed
    (run_dir,) = tmp_path.glob("*-smoke")
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["config"]["engine_options"]["max_model_len"] == SHORT_MODEL_CONTEXT
    (row,) = json.loads((run_dir / "summary.json").read_text())["rows"]
    assert row["completed"] == row["num_requests"] > 0 and row["errors"] == 0, row["errors_by_code"]


def test_a_configuration_vllm_refuses_is_one_line_with_vllms_reason_and_the_log(
    short_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # extra_args reach vLLM past every check here: vLLM itself refuses the length
    argv = ["run", "--engine", "vllm", *_model(short_model), "--stacks", "zerolayer"]
    argv += ["--engine-option", 'extra_args={"max_model_len": 4096}', "--profiles", "a"]
    argv += ["--scale", "smoke", "--replicas", "1", "--quiet", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "zl-bench: error: the zerolayer stack's replica zl-0 did not start: vLLM did not start: "
        "ModelConfig: User-specified max_model_len (4096) is greater than the derived "
        f"max_model_len (max_position_embeddings={SHORT_MODEL_CONTEXT}"
    ), err
    log = Path(err.rsplit("(log: ", 1)[1].rstrip(")\n"))
    assert log.name == "zl-replica-0.log" and "zl-replica: error: vLLM did not start" in (
        log.read_text()
    )
