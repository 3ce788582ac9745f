"""``zl-bench fidelity --against vllm`` and ``calibrate --engine vllm``.

The comparison, verdict, the sim's prompts and argument checks are pure and run everywhere; the two
end-to-end tests (marked ``vllm``) calibrate the real CPU vLLM on a small grid, load the profile
into the sim, and run the whole fidelity command at a handful of requests, on the session's
short model (``tests.support.models``), neither told its limits. They skip, with the
reason, where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.cli import main
from bench.fidelity_cells import Cell, compare, relative_error, table_markdown, verdict
from bench.fidelity_vllm import host_load_note, sim_requests
from harness.profile import load_profile
from harness.workload import build_schedule
from serving.wire.tokens import count_prompt_tokens
from tests.support.models import SHORT_MODEL_CONTEXT

vllm_installed = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
)


def summary(scale: float) -> dict[str, float]:
    return {
        f"p{p}_{m}_ms": scale * (i + 1) * p
        for i, m in enumerate(("ttft", "itl", "e2el"))
        for p in (50, 90, 99)
    }


def test_relative_error_is_the_sims_error_against_vllm() -> None:
    assert relative_error(100.0, 110.0) == pytest.approx(0.10)
    assert relative_error(100.0, 80.0) == pytest.approx(-0.20)
    assert relative_error(None, 1.0) is None
    assert relative_error(1.0, None) is None
    assert relative_error(0.0, 1.0) is None


@given(
    st.floats(min_value=0.01, max_value=1e6),
    st.floats(min_value=0.0, max_value=1e6),
    st.floats(min_value=0.01, max_value=0.99),
)
def test_a_cell_is_within_exactly_when_its_error_is(ref: float, sim: float, tol: float) -> None:
    cell = Cell("a_latency", "ttft", 50, ref, sim)
    assert cell.within(tol) == (abs(sim - ref) / ref <= tol)


def test_compare_and_verdict_over_the_nine_cells_of_a_profile() -> None:
    cells = compare("a_latency", summary(1.0), summary(1.1))
    assert [(c.metric, c.percentile) for c in cells] == [
        (m, p) for m in ("ttft", "itl", "e2el") for p in (50, 90, 99)
    ]
    assert all(c.error == pytest.approx(0.1) for c in cells)
    assert verdict(cells, 0.15)
    assert not verdict(cells, 0.05)
    missing = compare("c_mixed", summary(1.0), {**summary(1.0), "p99_itl_ms": None})
    assert not verdict(missing, 0.15)  # a missing figure is never agreement
    assert not verdict([], 0.15)


def test_the_table_shows_both_figures_and_the_error_per_cell() -> None:
    cells = compare("c_mixed", summary(1.0), summary(1.2))
    table = table_markdown(cells, 0.15)
    lines = table.splitlines()
    assert len(lines) == 2 + 9
    assert lines[2] == "| c_mixed | p50 TTFT | 50.0 | 60.0 | +20.0 % | NO |"
    assert "| a | p99 ITL | - | 1.0 | - | NO |" in table_markdown(
        [Cell("a", "itl", 99, None, 1.0)], 0.15
    )


def test_the_host_load_note_says_when_the_cores_were_oversubscribed() -> None:
    quiet = host_load_note({"a": {"host_load_1m": 1.5}}, {"a": {"host_load_1m": 0.7}}, 2)
    assert "vllm a 1.5, sim a 0.7" in quiet and "not oversubscribed" in quiet
    busy = host_load_note({"a": {"host_load_1m": 9.0}}, {"a": {"host_load_1m": 0.7}}, 2)
    assert "BUSY" in busy


def test_the_sim_gets_prompts_of_exactly_the_counted_tokens() -> None:
    requests = list(build_schedule(load_profile("a_latency", "smoke")))[:5]
    counts = [7, 300, 1, 2048, 55]
    for req, n in zip(sim_requests(requests, counts), counts, strict=True):
        assert count_prompt_tokens(req.prompt()) == n == req.prompt_tokens


HERE = ["--engine-option", "model=."]  # a directory, so the other checks are reached


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--against", "vllm"], "needs --engine-option model=DIR"),
        (["--against", "vllm", "--engine-option", "model=/nonexistent"], "does not exist"),
        (["--against", "vllm", *HERE, "--profiles", "z"], "unknown profile"),
        (["--against", "vllm", *HERE, "--scale", "huge"], "invalid choice"),
        (["--against", "vllm", *HERE, "--tolerance", "2"], "--tolerance must be"),
        (["--against", "vllm", *HERE, "--engine-option", "nope=1"], "valid options"),
        (["--against", "vllm", *HERE, "--calibration", "/none"], "is not a file"),
        (["--calibration", "/none"], "goes with --against vllm"),
        (["--against", "sim"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_error_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fidelity", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") or err.startswith("zl-bench fidelity: error")
    assert message in err and err.count("\n") == 1


# -- against the real CPU vLLM, on the session's short model (2,048 positions), not told its
# limits: calibrate fits its default decode contexts and prefill lengths inside them, fidelity
# its max_model_len and profile C's large prompts

FITTED = f"max_model_len {SHORT_MODEL_CONTEXT} (the model's context)"
LONGEST_DECODE = SHORT_MODEL_CONTEXT - 16  # bench.calibrate_vllm.DECODE_TOKENS past it
LONGEST_PREFILL = SHORT_MODEL_CONTEXT - 1


@pytest.fixture(scope="module")
def calibrated(short_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The profile ``calibrate --engine vllm`` wrote with its default grid's contexts and
    prefill lengths (two batch sizes, one repeat), and what it printed."""
    out = tmp_path_factory.mktemp("calibration") / "vllm.json"
    grid = ["--batches", "1,4", "--repeats", "1", "--warmup", "0"]
    argv = ["calibrate", "--engine", "vllm", "--engine-option", f"model={short_model}", *grid]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*argv, "--out", str(out)]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def calibration(calibrated: tuple[Path, str]) -> Path:
    return calibrated[0]


@pytest.mark.vllm
@vllm_installed
def test_calibrate_vllm_writes_a_profile_the_sim_loads(calibrated: tuple[Path, str]) -> None:
    from serving.engine import SimConfig, SimEngine

    calibration, printed = calibrated
    assert f"calibrate: {FITTED}" in printed
    assert f"decode contexts 128,1024,3072 -> 128,1024,{LONGEST_DECODE}, fitted" in printed
    assert f"prefill lengths 128,1024,3072 -> 128,1024,{LONGEST_PREFILL}, fitted" in printed
    profile = json.loads(calibration.read_text())
    entry = profile["models"]["vllm-tiny-2k"]
    contexts = (128, 1024, LONGEST_DECODE)
    assert set(entry["decode_step_graph_ms"]) == {f"{b}x{c}" for b in (1, 4) for c in contexts}
    assert set(entry["prefill_graph_ms"]) == {"128", "1024", str(LONGEST_PREFILL)}
    assert all(p["ms"] >= 0 for p in entry["decode_step_graph_ms"].values())
    assert all(ms > 0 for ms in entry["prefill_graph_ms"].values())
    assert entry["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 4  # K+V, 2 layers, 1 KV head, fp32
    limits = profile["calibration"]["limits"]
    assert limits["max_model_len"] == SHORT_MODEL_CONTEXT and limits["num_gpu_blocks"] > 0
    engine = SimEngine(SimConfig(profile_path=str(calibration), model_shape="vllm-tiny-2k"))
    for key, point in entry["decode_step_graph_ms"].items():
        batch, context = (int(v) for v in key.split("x"))
        assert engine.model.decode_ms(batch, context) == pytest.approx(point["ms"])


@pytest.mark.vllm
@vllm_installed
def test_fidelity_against_vllm_end_to_end(
    short_model: Path, calibration: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fidelity"
    argv = ["fidelity", "--against", "vllm", "--engine-option", f"model={short_model}"]
    argv += ["--calibration", str(calibration), "--max-requests", "4", "--out", str(out)]
    code = main(argv)
    assert code in (0, 1)  # agreement at 4 requests is not the point here; the table is
    doc = json.loads((out / "fidelity.json").read_text())
    assert doc["within"] == (code == 0)
    cells = doc["cells"]
    assert len(cells) == 2 * 9
    assert {c["profile"] for c in cells} == {"a_latency", "c_mixed"}
    # every request really streamed (a stalled replica can deliver a burst: ITL 0 is a figure)
    assert all(c["vllm_ms"] is not None and c["sim_ms"] is not None for c in cells)
    for side in ("vllm", "sim"):
        for name in ("a_latency", "c_mixed"):
            records = (out / f"{name}-{side}.jsonl").read_text().splitlines()
            assert len(records) == 4
            assert all(json.loads(r)["outcome"] == "completed" for r in records)
    assert (out / "fidelity.md").read_text().startswith("| profile | metric |")
    printed = capsys.readouterr().out
    assert "p50 TTFT" in printed and f"fidelity: {FITTED}" in printed
    assert (
        "c_mixed class large: 8000 B -> " in printed and "clamped to fit max_model_len" in printed
    )
