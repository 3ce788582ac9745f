"""The calibration command: measures the tiny torch model and writes a profile the sim loads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

import argparse

from zerolayer.engine import EngineRequest, SimConfig, SimEngine
from zerolayer.engine.calibrate import add_arguments, run_command
from zerolayer.engine.stepmodel import load_profile, model_shape
from zerolayer.engine.torch_engine.model import SHAPES


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
