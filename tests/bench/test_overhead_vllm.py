"""``zl-bench overhead --engine vllm`` against the real CPU vLLM (``nox -s vllm``): the in-process
``AsyncLLM``, the zero-layer stack and vLLM's own server, in one short run on the session's short
model with a KV cache smaller than its context (``max_model_len`` not given: capped to the cache)
(4 minutes on two cores shared with two other vLLM runs, almost all of it three engine starts).
Ray Serve LLM is left to the manual run: its start alone takes about a minute here. Where vLLM
is not installed, this skips with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from bench.overhead import add_arguments, run_command

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (the CPU build installs with: nox -s vllm)",
    ),
]

TARGETS = ("inproc", "zerolayer", "vllm-serve")
MAX_TOKENS = 16
LEVELS = (1, 4)


# 2 MiB of KV is 16 blocks of 128 of this model's tokens, one of which vLLM keeps back: under
# the model's 2,048 positions, so max_model_len is capped to what the cache holds, and said
KV_BYTES = 2 << 20
CAPPED = f"max_model_len {15 * 128} (capped: the KV cache (2 MiB at 1024 B a token) holds"


def test_three_stacks_serve_exact_streams_and_get_a_verdict(
    short_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {"kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 8}
    argv = ["--engine", "vllm", "--engine-option", f"model={short_model}"]
    argv += ["--targets", ",".join(TARGETS)]
    argv += ["--levels", ",".join(map(str, LEVELS)), "--duration", "1", "--warmup", "0.3"]
    argv += ["--repeats", "1"]
    argv += ["--max-tokens", str(MAX_TOKENS), "--out", str(tmp_path)]
    for key, value in options.items():
        argv += ["--engine-option", f"{key}={value}"]
    args = parser.parse_args(argv)
    assert run_command(args) == 0
    out = capsys.readouterr().out
    assert f"overhead: {CAPPED} 1920 of its 2048)" in out
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["rate_source"].endswith("in-process closed-loop throughput")
    by = {(r["target"], r["in_flight"]): r for r in doc["rows"]}
    assert {r["repeat"] for r in doc["rows"]} == {1}
    assert set(by) == {(t, n) for t in TARGETS for n in LEVELS}
    for (target, n), r in by.items():
        assert r["errors"] == 0 and r["completed"] > 0, (target, n, r["error_codes"])
        assert r["tokens_per_request"] == str(MAX_TOKENS) and r["short_streams"] == 0, r
        assert r["tokens_total"] == r["completed"] * MAX_TOKENS
        # every target's server includes vLLM's engine core: it spends CPU on every token
        assert r["server_cpu_us_per_token"] > 0, (target, n)
        if target != "inproc":
            # a level of 1 s at one in flight may cost the layer less than one clock tick (10 ms)
            # on a busy host: each level's figure is bounded, their sum is counted
            assert 0 <= r["layer_cpu_s"] < r["server_cpu_s"], (target, n)
            assert r["added_e2el_p50_ms"] is not None
    for target in TARGETS:
        if target != "inproc":
            assert sum(by[target, n]["layer_cpu_s"] for n in LEVELS) > 0, target
    assert doc["workload"]["cpu_layout"] is not None, "every engine on the layout's cores"
    peer, floor = doc["verdict"]
    assert peer.startswith("verdict: zerolayer against vllm-serve, vLLM's own server")
    assert floor.startswith("verdict: zerolayer against inproc, the in-process engine")
    assert "too few valid trials" in peer or "not measured" in peer, "one repeat decides nothing"
    assert peer in out and "| vllm-serve | 4 |" in (tmp_path / "overhead.md").read_text()
