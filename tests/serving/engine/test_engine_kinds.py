"""The engine kinds table: every engine name has one kind, which says its config class, builds an
engine of that name, names its token rule and answers for its capacity; other names are refused
with the list."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import io
import math
from typing import Any

import pytest

from harness.capacity import kv_tokens, preflight
from harness.profile import load_profile
from serving.engine import ENGINE_KINDS, ENGINES, make_engine
from serving.engine.kinds import engine_kind
from serving.engine.sim import SimConfig
from serving.engine.tokenrules import BYTES_RULE, TokenRule

HAVE_TORCH = importlib.util.find_spec("torch") is not None
# Options that build each engine here, without a GPU or a model directory.
BUILD_OPTIONS: dict[str, dict[str, Any]] = {
    "sim": {"num_kv_blocks": 64},
    "null": {},
    "torch": {"model_shape": "tiny", "device": "cpu"},
    "vllm": {"model": "/models/none"},
}


def test_every_engine_name_has_its_kind() -> None:
    assert tuple(ENGINE_KINDS) == ENGINES and set(ENGINES) == set(BUILD_OPTIONS)
    for name in ENGINES:
        kind = engine_kind(name)
        assert kind.name == name and kind.summary


def test_an_unknown_engine_is_refused_with_the_list() -> None:
    with pytest.raises(
        ValueError, match="unknown engine 'gpu'; choose from sim, null, torch, vllm"
    ):
        engine_kind("gpu")
    with pytest.raises(ValueError, match="choose from"):
        make_engine("gpu")


@pytest.mark.parametrize("name", ENGINES)
def test_each_kind_has_a_config_dataclass(name: str) -> None:
    if name == "torch" and not HAVE_TORCH:
        pytest.skip("the torch extra is not installed")
    assert dataclasses.is_dataclass(engine_kind(name).config_class)


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM engine over the adapter tests' stand-in engine core, not vLLM itself."""
    from serving.engine import vllm_engine
    from tests.support.fake_vllm import DELTA, FakeAsyncLLMForTests

    api = vllm_engine.VllmApi(FakeAsyncLLMForTests, dict, dict, DELTA, None)
    monkeypatch.setattr(vllm_engine, "load_vllm_api", lambda: api)


@pytest.mark.parametrize("name", ENGINES)
def test_each_kind_builds_an_engine_of_its_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "torch" and not HAVE_TORCH:
        pytest.skip("the torch extra is not installed")
    if name == "vllm":
        _fake_vllm(monkeypatch)
    engine = make_engine(name, **BUILD_OPTIONS[name])
    assert engine.name == name
    asyncio.run(engine.close())


@pytest.mark.parametrize("name", ENGINES)
def test_each_kind_has_a_token_rule(name: str) -> None:
    """Without a model directory every engine counts by the wire's bytes rule."""
    rule = engine_kind(name).token_rule({})
    assert isinstance(rule, TokenRule) and rule is BYTES_RULE


def test_only_vllm_counts_with_a_models_tokenizer(tmp_path: Any) -> None:
    options = {"model": str(tmp_path / "none")}
    for name in ENGINES:
        if engine_kind(name).serves_vllm:
            with pytest.raises(ValueError, match="not a local model directory"):
                engine_kind(name).token_rule(options)
        else:
            assert engine_kind(name).token_rule(options) is BYTES_RULE


@pytest.mark.parametrize("name", ENGINES)
def test_each_kind_answers_for_its_capacity(name: str) -> None:
    """A reference engine has no limit, a modelled one a figure, any other an unknown one."""
    kind = engine_kind(name)
    cap = preflight(load_profile("a", "smoke"), name, 1, {}, stream=io.StringIO())
    if kind.is_reference:
        assert cap.requests_per_s == math.inf and cap.multiple == 0.0
        assert "no compute limit" in cap.lines()[0]
    elif kind.has_step_model:
        assert cap.requests_per_s is not None and 0 < cap.requests_per_s < math.inf
    else:
        assert cap.requests_per_s is None and "no step-time model" in cap.reason
    assert (kv_tokens(name, {}) is not None) == kind.has_step_model


def test_a_modelled_engine_is_sized_by_its_options() -> None:
    modelled = engine_kind("sim").modelled_engine
    assert modelled is not None
    small = modelled({"num_kv_blocks": 10, "block_size": 32, "max_num_seqs": 3})
    assert small.kv_tokens == 320 and small.max_num_seqs == 3
    assert small.label == f"sim:{SimConfig().model_shape}"
    assert small.max_model_len == SimConfig().max_model_len


def test_the_kinds_flags_say_what_each_engine_is() -> None:
    reference = [n for n in ENGINES if engine_kind(n).is_reference]
    real = [n for n in ENGINES if engine_kind(n).runs_model]
    assert reference == ["null"] and not engine_kind("null").has_kv_cache
    assert real == ["torch", "vllm"] and [n for n in real if engine_kind(n).serves_vllm] == ["vllm"]
    assert [n for n in ENGINES if engine_kind(n).has_step_model] == ["sim"]
