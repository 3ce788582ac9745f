"""The capacity preflight: the sim's prediction, and "unknown capacity" where there is none."""

from __future__ import annotations

import io

import pytest

from harness.capacity import kv_tokens, predict, preflight
from harness.profile import load_profile


def test_capacity_preflight_scales_and_warns() -> None:
    a = load_profile("a", "laptop")
    one = predict(a, replicas=1)
    two = predict(a, replicas=2)
    assert one.requests_per_s is not None and two.requests_per_s is not None
    assert one.requests_per_s > a.rate  # the laptop scale is not an overload
    assert two.requests_per_s == pytest.approx(2 * one.requests_per_s)
    assert one.multiple == pytest.approx(a.rate / one.requests_per_s)
    assert one.output_tokens_per_s == pytest.approx(one.requests_per_s * 128)
    # Longer prompts and outputs cost more per request.
    b_rps = predict(load_profile("b", "laptop")).requests_per_s
    assert b_rps is not None and b_rps < one.requests_per_s
    out = io.StringIO()
    cap = preflight(load_profile("a", "seed"), stream=out)
    text = out.getvalue()
    assert cap.overloaded and "WARNING" in text and f"{cap.multiple:.2f}x" in text
    quiet = io.StringIO()
    preflight(a, stream=quiet)
    assert "WARNING" not in quiet.getvalue() and "0." in quiet.getvalue()
    assert predict(a, engine="null").multiple == 0.0


def test_engine_options_reach_the_prediction() -> None:
    a = load_profile("a", "laptop")
    full = preflight(a, "sim", 1, {}, stream=io.StringIO())
    tiny = preflight(a, "sim", 1, {"max_num_seqs": 1}, stream=io.StringIO())
    assert full.requests_per_s is not None and tiny.requests_per_s is not None
    assert tiny.requests_per_s < full.requests_per_s and tiny.batch == 1


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_engines_without_a_model_get_unknown_capacity(engine: str) -> None:
    out = io.StringIO()
    cap = preflight(load_profile("a", "smoke"), engine, 2, {"anything": 1}, stream=out)
    assert cap.requests_per_s is None and cap.multiple is None and not cap.overloaded
    assert f"no step-time model for engine {engine!r}" in cap.reason
    assert "unknown capacity" in out.getvalue() and cap.as_dict()["requests_per_s"] is None


@pytest.mark.parametrize("engine", ["sim", "null", "torch"])
def test_external_stacks_get_unknown_capacity(engine: str) -> None:
    out = io.StringIO()
    cap = preflight(load_profile("a", "smoke"), engine, 2, None, external=True, stream=out)
    assert cap.requests_per_s is None and "external" in cap.reason
    assert "unknown capacity" in out.getvalue()


def test_kv_tokens_come_from_the_engine_config() -> None:
    assert kv_tokens("sim", {"num_kv_blocks": 2048}) == 2048 * 16
    assert kv_tokens("sim", {"num_kv_blocks": 100, "block_size": 32}) == 3200
    full = kv_tokens("sim", {})
    assert full is not None and full > 100_000
    assert kv_tokens("torch", {}) is None and kv_tokens("null", {}) is None
