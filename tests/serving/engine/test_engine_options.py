"""``--engine-option KEY=VALUE``: the one parser and the one validator every command uses."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.engine import ENGINES, make_engine
from serving.engine.options import parse_engine_option, validate_engine_options
from serving.engine.sim import SimConfig

KEYS = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
SIM_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")


@given(KEYS, JSON_VALUES)
def test_a_json_value_comes_back_as_itself(key: str, value: object) -> None:
    assert parse_engine_option(f"{key}={json.dumps(value)}") == (key, value)


@given(KEYS, st.text(min_size=1).filter(lambda t: not _is_json(t)))
def test_a_value_that_is_not_json_stays_a_string(key: str, raw: str) -> None:
    assert parse_engine_option(f"{key}={raw}") == (key, raw)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_dashes_in_the_key_become_underscores_and_only_the_first_equals_splits() -> None:
    assert parse_engine_option("num-kv-blocks=64") == ("num_kv_blocks", 64)
    assert parse_engine_option("profile_path=a=b") == ("profile_path", "a=b")
    assert parse_engine_option("model_shape=") == ("model_shape", "")


@pytest.mark.parametrize("text", ["", "=1", "novalue", " =x"])
def test_text_without_a_key_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_engine_option(text)


@given(st.sampled_from(SIM_COUNTS), st.integers(min_value=1, max_value=1 << 40))
def test_any_positive_count_is_a_valid_sim_option(key: str, value: int) -> None:
    assert validate_engine_options("sim", {key: value}) == {key: value}


@given(st.sampled_from(SIM_COUNTS), st.integers(max_value=0))
def test_a_count_below_one_is_refused_naming_it(key: str, value: int) -> None:
    with pytest.raises(ValueError, match=key):
        validate_engine_options("sim", {key: value})


@given(KEYS.filter(lambda k: k not in {f.name for f in dataclasses.fields(SimConfig)}))
def test_an_unknown_key_is_refused_listing_every_valid_one(key: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_engine_options("sim", {key: 1})
    message = str(caught.value)
    assert repr(key) in message
    assert all(f.name in message for f in dataclasses.fields(SimConfig))


@pytest.mark.parametrize(
    ("engine", "options", "says"),
    [
        ("sim", {"max_num_seqs": "4"}, "max_num_seqs takes int"),
        ("sim", {"max_num_seqs": True}, "max_num_seqs takes int"),
        ("sim", {"num_kv_blocks": 1.5}, "num_kv_blocks takes int | None"),
        ("sim", {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ("sim", {"model_shape": "nope"}, "unknown model shape 'nope'; the profile has: llama"),
        ("null", {"x": 1}, "valid options: per_token, itl_ms"),
        ("null", {"itl_ms": -1.0}, "itl_ms must be >= 0"),
        ("null", {"per_token": False, "itl_ms": 2.0}, "itl_ms needs per_token"),
        ("vllm", {"extra_args": [1]}, "extra_args takes dict"),
        ("tpu", {}, "choose from " + ", ".join(ENGINES)),
    ],
)
def test_wrong_types_values_and_engines_are_refused(
    engine: str, options: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        validate_engine_options(engine, options)


def test_the_result_is_clean_and_builds_the_engine() -> None:
    options = validate_engine_options(
        "sim", {"num-kv-blocks": 64, "gpu_memory_utilization": 1, "num_kv_blocks": None}
    )
    assert options == {"num_kv_blocks": None, "gpu_memory_utilization": 1.0}
    assert isinstance(options["gpu_memory_utilization"], float)
    assert validate_engine_options("null", {}) == {}
    assert validate_engine_options("vllm", {"model": "/m", "extra_args": {"a": 1}})["model"] == "/m"


def test_make_engine_refuses_an_unknown_option_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid options: model_shape"):
        make_engine("sim", num_kv_block=4)


@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_seed_003s_fixed_shapes_are_options_of_each_engine_fragmentation_runs(engine: str) -> None:
    """``zl-bench fragmentation --engine vllm`` stood its replica up with the fixed shapes'
    options and the replica refused ``enable_prefix_caching``: one spelling for both engines,
    and vLLM's own server gets it as its flag."""
    from harness.variants import FIXED_SHAPES
    from serving.engine.vllm_engine import server_flags

    options = FIXED_SHAPES.options({"model": "/m"} if engine == "vllm" else {})
    assert validate_engine_options(engine, options) == options
    if engine == "vllm":
        flags = server_flags(options, on_cpu=False)
        assert "--no-enable-prefix-caching" in flags
        assert flags[flags.index("--max-model-len") + 1] == "4096"
