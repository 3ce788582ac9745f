"""The calibration command: measures the tiny torch model and writes a profile the sim loads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch", reason="the torch extra is not installed")

import argparse

from bench.calibrate import add_arguments, run_command
from serving.engine import EngineRequest, SimConfig, SimEngine
from serving.engine.stepmodel import load_profile, model_shape
from serving.engine.torch_engine.model import SHAPES


def main(argv: Sequence[str]) -> int:
    """What ``zl-bench calibrate ARGS`` does: parse with the module's arguments, then run."""
    parser = argparse.ArgumentParser(prog="calibrate")
    add_arguments(parser)
    return run_command(parser.parse_args(argv))


CPU_TINY = ["--engine-option", "model_shape=tiny", "--engine-option", "device=cpu"]
GRID = [
    "--batches",
    "1,4",
    "--contexts",
    "32,128",
    "--prefill",
    "16,64,256",
    "--repeats",
    "2",
    "--warmup",
    "1",
]


def test_calibrated_profile_loads_into_the_sim(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    args = ["--engine", "torch", *CPU_TINY, "--out", str(out)]
    assert main([*args, *GRID]) == 0
    entry = load_profile(out)["models"]["tiny"]
    assert set(entry["decode_step_graph_ms"]) == {"1x32", "1x128", "4x32", "4x128"}
    assert set(entry["prefill_graph_ms"]) == {"16", "64", "256"}
    tiny = SHAPES["tiny"]
    assert entry["params"] == tiny.params and entry["weight_bytes"] == 4 * tiny.params
    assert entry["kv_bytes_per_token"] == tiny.kv_bytes_per_token(4)
    point = entry["decode_step_graph_ms"]["4x128"]
    assert point["ms"] > 0
    assert point["bytes"] - entry["decode_step_graph_ms"]["4x32"]["bytes"] == 4 * 96 * 512

    engine = SimEngine(SimConfig(profile_path=str(out), model_shape="tiny"))
    for key, value in entry["decode_step_graph_ms"].items():
        batch, context = (int(v) for v in key.split("x"))
        assert engine.model.decode_ms(batch, context) == pytest.approx(value["ms"])

    async def one() -> int:
        count = 0
        async for chunk in engine.generate(EngineRequest("c", 40, 5, seed=3)):
            count += len(chunk.token_ids)
        await engine.close()
        return count

    assert asyncio.run(one()) == 5


def test_a_second_model_is_added_and_bad_input_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(load_profile()))
    assert main([*CPU_TINY, "--name", "tiny-cpu", "--out", str(out), *GRID]) == 0
    profile = load_profile(out)
    assert {"llama-3.1-8b", "llama-3.2-1b", "tiny-cpu"} <= set(profile["models"])
    model_shape("tiny-cpu", profile)
    with pytest.raises(ValueError, match="at least 3 prefill lengths"):
        main([*CPU_TINY, "--out", str(out), "--prefill", "16,64"])
    with pytest.raises(ValueError, match="valid options: model_shape"):
        main(["--engine-option", "model_shap=tiny", "--out", str(out)])
    with pytest.raises(ValueError, match="unknown model shape"):
        main(["--engine-option", "model_shape=huge", "--out", str(out)])
    with pytest.raises(ValueError, match="is a directory"):
        main([*CPU_TINY, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="repeats >= 1"):
        main([*CPU_TINY, "--out", str(out), "--repeats", "0"])
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ValueError, match="not a profile"):
        main([*CPU_TINY, "--out", str(tmp_path / "junk.json")])
    with pytest.raises(SystemExit):  # argparse's own check of the grid's syntax
        main([*CPU_TINY, "--out", str(out), "--batches", "0,2"])


# -- the vLLM calibration's pieces that need no vLLM -------------------------------------------


def test_decode_step_is_the_difference_over_the_steps() -> None:
    from bench.calibrate_vllm import decode_step_ms

    assert decode_step_ms(0.050, 0.010, 16) == pytest.approx(2.5)
    assert decode_step_ms(0.010, 0.012, 16) == 0.0  # noise never makes a negative step
    with pytest.raises(ValueError):
        decode_step_ms(1.0, 0.5, 0)


@given(
    st.floats(min_value=0.1, max_value=10.0),
    st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=0.0, max_value=1e-3),
)
def test_smoothing_keeps_a_plane_and_pulls_an_outlier_back(
    fixed: float, per_seq: float, per_token: float
) -> None:
    from bench.calibrate_vllm import smooth_decode

    def plane(b: int, c: int) -> float:
        return fixed + per_seq * b + per_token * b * c

    grid = {(b, c): plane(b, c) for b in (1, 4, 16) for c in (128, 1024, 3072)}
    for key, ms in smooth_decode(grid).items():
        assert ms == pytest.approx(grid[key], rel=1e-6, abs=1e-6)
    for corner in ((16, 128), (16, 3072), (1, 128)):  # 16 x 3072 pulls a plain fit hardest
        noisy = {**grid, corner: grid[corner] + 40.0, (4, 1024): grid[(4, 1024)] * 1.01}
        smoothed = smooth_decode(noisy)
        for key in grid:
            assert smoothed[key] == pytest.approx(grid[key], rel=0.15, abs=0.1)


def test_smoothing_never_makes_a_step_cheaper_with_more_sequences() -> None:
    from bench.calibrate_vllm import smooth_decode

    measured = {  # a served calibration on the shared 2-core machine, 16 x 3072 hit by a burst
        (1, 128): 3.212, (1, 1024): 2.867, (1, 3072): 3.287,
        (4, 128): 3.886, (4, 1024): 4.021, (4, 3072): 5.128,
        (16, 128): 5.766, (16, 1024): 6.574, (16, 3072): 51.716,
    }  # fmt: skip
    smoothed = smooth_decode(measured)
    assert smoothed[(16, 3072)] < 15.0
    for c in (128, 1024, 3072):
        assert smoothed[(1, c)] <= smoothed[(4, c)] <= smoothed[(16, c)]
    for b in (1, 4, 16):
        assert smoothed[(b, 128)] <= smoothed[(b, 1024)] <= smoothed[(b, 3072)]
    # the plane is an approximation: the other points stay within a third of their medians
    assert all(abs(smoothed[k] / v - 1) < 0.35 for k, v in measured.items() if k != (16, 3072))


def test_a_grid_that_cannot_fix_the_plane_is_kept_as_measured() -> None:
    from bench.calibrate_vllm import smooth_decode

    one_batch = {(1, 128): 2.0, (1, 1024): 2.5, (1, 3072): 1.0}
    assert smooth_decode(one_batch) == one_batch


def test_vllm_calibration_refuses_bad_input_before_starting_vllm(tmp_path: Path) -> None:
    out = str(tmp_path / "p.json")
    with pytest.raises(ValueError, match="needs --engine-option model=DIR"):
        main(["--engine", "vllm", "--out", out])
    with pytest.raises(ValueError, match="none does not exist"):
        main(["--engine", "vllm", "--engine-option", f"model={tmp_path / 'none'}", "--out", out])
    with pytest.raises(ValueError, match=r"has no config\.json"):
        main(["--engine", "vllm", "--engine-option", f"model={tmp_path}", "--out", out])
    with pytest.raises(ValueError, match="valid options: model"):
        main(["--engine", "vllm", "--engine-option", "modle=x", "--out", out])
    with pytest.raises(ValueError, match="at least 3 prefill lengths"):
        main(
            [
                "--engine",
                "vllm",
                "--engine-option",
                f"model={tmp_path}",
                "--out",
                out,
                "--prefill",
                "1,2",
            ]
        )


def test_each_engine_has_its_own_default_grid() -> None:
    from bench.calibrate import CALIBRATORS, grid_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    vllm = grid_from_args(parser.parse_args(["--engine", "vllm", "--out", "p"]))
    assert vllm == CALIBRATORS["vllm"].grid and vllm != CALIBRATORS["torch"].grid
    mixed = grid_from_args(parser.parse_args(["--engine", "vllm", "--out", "p", "--repeats", "7"]))
    assert mixed.repeats == 7 and mixed.batches == CALIBRATORS["vllm"].grid.batches
