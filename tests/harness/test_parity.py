"""Configuration parity (``harness.parity``): the pure comparison of the stacks' engine settings,
the codec the settings travel in, and the reading of real stood-up stacks (zero-layer replicas
over the sim, loopback only; the Ray Serve orchestrator baseline, whose engine replicas publish
their settings with their stats)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.parity import SETTINGS, ParityError, check_parity, compare, compared, mismatch_line
from harness.schema import SettingsMismatch
from harness.stacks import Stack, StackName, StackSpec, stand_up
from harness.telemetry.engine import metrics_settings
from serving.engine import SimConfig, SimEngine
from serving.engine.settings import EngineSettings, settings_from_labels, settings_labels
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = STACK_IN_A_FIXTURE

SIM = EngineSettings(
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=4096,
    block_size=16,
    kv_blocks=1000,
    prefix_caching=True,
    chunked_prefill=True,
)
EVERY = dataclasses.replace(SIM, dtype="float32", temperature=0.0)  # a value for every setting

settings_st = st.builds(
    EngineSettings,
    max_num_seqs=st.none() | st.integers(1, 4096),
    max_num_batched_tokens=st.none() | st.integers(1, 1 << 20),
    max_model_len=st.none() | st.integers(1, 1 << 20),
    block_size=st.none() | st.sampled_from([1, 16, 32, 128]),
    kv_blocks=st.none() | st.integers(1, 1 << 24),
    prefix_caching=st.none() | st.booleans(),
    chunked_prefill=st.none() | st.booleans(),
    dtype=st.none() | st.sampled_from(["float32", "bfloat16", "float16"]),
    temperature=st.none() | st.floats(0.0, 2.0, allow_nan=False),
)
layout_st = st.lists(st.integers(1, 3), min_size=2, max_size=3)  # replicas per stack


def _stacks(settings: EngineSettings, replicas: list[int]) -> dict[str, dict[str, EngineSettings]]:
    return {f"s{i}": {f"r{j}": settings for j in range(n)} for i, n in enumerate(replicas)}


def _with(settings: EngineSettings, setting: str, value: Any) -> EngineSettings:
    changes: dict[str, Any] = {setting: value}
    return dataclasses.replace(settings, **changes)


def _other(value: object) -> object:
    """A value of the same type that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}-other"


@given(settings_st, layout_st)
def test_identical_settings_never_mismatch(settings: EngineSettings, replicas: list[int]) -> None:
    assert compare(_stacks(settings, replicas)) == []


@given(settings_st, layout_st, st.sampled_from(SETTINGS), st.data())
def test_any_one_differing_setting_is_named_with_each_stacks_value(
    settings: EngineSettings,
    replicas: list[int],
    setting: str,
    data: st.DataObject,
) -> None:
    if getattr(settings, setting) is None:
        settings = _with(settings, setting, getattr(EVERY, setting))
    stacks = _stacks(settings, replicas)
    odd = data.draw(st.sampled_from(sorted(stacks)))
    changed = _with(settings, setting, _other(getattr(settings, setting)))
    stacks[odd] = dict.fromkeys(stacks[odd], changed)
    (mismatch,) = compare(stacks)
    assert mismatch.setting == setting
    assert mismatch.values[odd] == getattr(changed, setting)
    assert {v for k, v in mismatch.values.items() if k != odd} == {getattr(settings, setting)}
    assert setting in compared(stacks)


def test_a_setting_only_one_stack_has_is_not_compared() -> None:
    stacks = {"zerolayer": {"zl-0": EVERY}, "vllm-serve": {"vllm-0": SIM}}
    assert compare(stacks) == []
    assert "dtype" not in compared(stacks) and "max_num_seqs" in compared(stacks)


def test_replicas_of_one_stack_that_disagree_are_named_one_by_one() -> None:
    eight = dataclasses.replace(SIM, max_num_seqs=8)
    stacks = {"zerolayer": {"zl-0": SIM, "zl-1": eight}, "baseline": {"serve-0": SIM}}
    assert compare(stacks) == [
        SettingsMismatch(
            "max_num_seqs", {"zerolayer/zl-0": 256, "zerolayer/zl-1": 8, "baseline": 256}
        )
    ]


def test_the_error_is_one_line_naming_each_setting_and_value() -> None:
    line = mismatch_line(
        [
            SettingsMismatch("max_num_seqs", {"zerolayer": 1024, "baseline": 128}),
            SettingsMismatch("prefix_caching", {"zerolayer": True, "baseline": False}),
        ]
    )
    assert "\n" not in line
    assert "max_num_seqs: zerolayer 1024, baseline 128" in line
    assert "prefix_caching: zerolayer True, baseline False" in line and "--allow-mismatch" in line


@given(settings_st)
def test_settings_round_trip_through_their_labels(settings: EngineSettings) -> None:
    assert settings_from_labels(settings_labels(settings)) == settings


def test_vllms_cache_config_info_gives_its_cache_settings() -> None:
    """vLLM's own server publishes its CacheConfig as an info gauge (every field a label)."""
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
        'engine="0",num_gpu_blocks="34",gpu_memory_utilization="0.9"} 1.0\n'
    )
    assert metrics_settings(text) == EngineSettings(
        block_size=128, kv_blocks=34, prefix_caching=True
    )
    assert metrics_settings("vllm:num_requests_running 0\n") == EngineSettings()


def test_the_sim_reports_what_it_runs_with() -> None:
    engine = SimEngine(
        SimConfig(model_shape="llama-3.2-1b", max_num_seqs=8, num_kv_blocks=64, block_size=32)
    )
    assert engine.settings() == EngineSettings(
        max_num_seqs=8,
        max_num_batched_tokens=8192,
        max_model_len=131_072,
        block_size=32,
        kv_blocks=64,
        prefix_caching=True,
        chunked_prefill=True,
    )
    plain = SimEngine(SimConfig(num_kv_blocks=64, enable_prefix_caching=False))
    assert plain.settings().prefix_caching is False


# -- real stacks: what each kind reads from its stood-up engines -------------------------------

OPTIONS: dict[str, Any] = {"model_shape": "llama-3.2-1b", "num_kv_blocks": 64}


def _up(tmp_path: Path, name: StackName, **options: object) -> Stack:
    spec = StackSpec(name, engine="sim", engine_options={**OPTIONS, **options}, replicas=2)
    return stand_up(spec, tmp_path / name.value)


def test_a_zero_layer_stack_reports_each_replicas_engine_settings(tmp_path: Path) -> None:
    with _up(tmp_path, StackName.ZEROLAYER, max_num_seqs=8) as stack:
        found = stack.engine_settings()
    expected = SimEngine(SimConfig(**OPTIONS, max_num_seqs=8)).settings()
    assert found == {"zl-0": expected, "zl-1": expected}
    assert expected.max_num_seqs == 8 and expected.kv_blocks == 64


def test_a_null_engine_reports_nothing_to_compare(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1)
    with stand_up(spec, tmp_path) as stack:
        assert stack.engine_settings() == {"zl-0": EngineSettings()}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The orchestrator baseline over the sim (a local Ray), stood up once for the module."""
    with _up(tmp_path_factory.mktemp("parity"), StackName.BASELINE, max_num_seqs=16) as stack:
        yield stack


@pytest.mark.slow
def test_the_baselines_engine_replicas_publish_their_settings(baseline: Stack) -> None:
    expected = SimEngine(SimConfig(**OPTIONS, max_num_seqs=16)).settings()
    assert baseline.engine_settings() == {"serve-0": expected, "serve-1": expected}


@pytest.mark.slow
def test_stacks_whose_engines_agree_pass_and_are_recorded(baseline: Stack, tmp_path: Path) -> None:
    with _up(tmp_path, StackName.ZEROLAYER, max_num_seqs=16) as zerolayer:
        assert check_parity([zerolayer, baseline], allow_mismatch=False) == []


@pytest.mark.slow
def test_a_stack_whose_engines_differ_stops_the_check(baseline: Stack, tmp_path: Path) -> None:
    with _up(tmp_path, StackName.ZEROLAYER, max_num_seqs=8) as zerolayer:
        with pytest.raises(ParityError) as stopped:
            check_parity([zerolayer, baseline], allow_mismatch=False)
        allowed = check_parity([zerolayer, baseline], allow_mismatch=True)
    assert "max_num_seqs: zerolayer 8, baseline 16" in str(stopped.value)
    assert allowed == [SettingsMismatch("max_num_seqs", {"zerolayer": 8, "baseline": 16})]
