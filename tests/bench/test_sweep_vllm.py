"""``zl-bench sweep --engine vllm`` against the real CPU vLLM (``nox -s vllm``): the zero-layer
replica and vLLM's own server, each over the offline tiny model, at two rates of profile A, so the
load-curve path is known to run on a real engine and not only on the simulator (on a loaded host
the stack may saturate at the first rate: the sweep then stops there and says why). Ray Serve LLM is
left out for time (its start alone takes about a minute here). Where vLLM is not installed, this
skips with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from bench.sweep import add_arguments, run_command
from harness import schema

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

STACKS = ("zerolayer", "vllm-serve")
RATES = (1.0, 2.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("sweep-vllm") / "tiny")


def test_a_real_engine_sweep_measures_every_rate_on_both_stacks(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--engine", "vllm", "--engine-option", f"model={model_dir}", "--replicas", "1"]
    argv += ["--engine-option", "max_model_len=2048", "--engine-option", "max_num_seqs=8"]
    argv += ["--stacks", ",".join(STACKS), "--scale", "smoke", "--repeats", "1", "--quiet"]
    argv += ["--rates", ",".join(map(str, RATES)), "--out", str(tmp_path)]
    assert run_command(parser.parse_args(argv)) == 0
    (run,) = [p for p in tmp_path.iterdir() if (p / schema.RUN_META).exists()]
    section = schema.read_sweep(run)
    assert section is not None and section.capacity_rps is None  # no step model for vLLM
    for stack in STACKS:
        points = section.stack_points(stack)
        measured = [p.offered_rate for p in points]
        # Both rates, or (a loaded host saturating the stack at the first) the rates up to the
        # one where the sweep stopped, with the reason it gives for stopping.
        stopped = section.stacks[stack]["stopped"]
        assert measured == list(RATES) or (
            measured == list(RATES[: len(measured)]) and measured and stopped
        ), (stack, section.stacks)
        for p in points:
            assert p.num_requests > 0 and p.completed == p.num_requests, (stack, p.errors_by_code)
            assert p.stat("median_ttft_ms") is not None and p.host_cpu_pct is not None
        assert section.stacks[stack]["headline"]["max_goodput"]["value"] is not None
