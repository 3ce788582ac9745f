"""Ray Serve LLM's engine replicas on their own cores: the runtime environment that carries the
core lists, and each replica's worker claiming one list no live replica holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from baselines.rayserve_llm.config import LlmBaselineConfig
from baselines.rayserve_llm.cpus import claim, runtime_env


def test_ray_serve_llm_replicas_claim_their_core_lists_once_each(tmp_path: Path) -> None:
    env = runtime_env(["1", "2-3"], str(tmp_path))
    assert env["env_vars"] == {
        "ZL_ENGINE_CORE_LISTS": "1|2-3",
        "ZL_ENGINE_CORE_SLOTS": str(tmp_path),
    }
    assert env["worker_process_setup_hook"] == "baselines.rayserve_llm.cpus.claim_engine_cores"
    me = os.getpid()
    assert claim(tmp_path, 2, me) == 0 and claim(tmp_path, 2, me) == 1
    assert claim(tmp_path, 2, me) is None, "both held by a live process"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "engine-0").write_text(str(gone.pid))
    assert claim(tmp_path, 2, me) == 0, "a replaced replica's cores go to its successor"


def test_the_llm_config_carries_the_core_lists_only_when_given(tmp_path: Path) -> None:
    plain = LlmBaselineConfig(model=str(tmp_path))
    placed = LlmBaselineConfig(model=str(tmp_path), engine_cores=("1",), slots_dir=str(tmp_path))
    assert placed.metadata()["engine_cores"] == ["1"] and plain.metadata()["engine_cores"] == []
