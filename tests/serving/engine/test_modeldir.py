"""A model directory's limits read before any engine starts, and ``max_model_len`` fitted to
them (``serving.engine.modeldir``, ``vllm_engine.fit_vllm_options``); vLLM's refusal at start
as one line (``startup_reason``). No vLLM needed: the directories are written here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.calibrate_vllm import kv_bytes_per_token
from serving.engine.modeldir import (
    VLLM_DEFAULT_CONTEXT,
    ModelDir,
    derived_context,
    fit_max_model_len,
    kv_room,
    read_model_dir,
)
from serving.engine.vllm_engine import fit_vllm_options, startup_reason

LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def model(tmp_path: Path, tokenizer: bool = True, **config: Any) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **config}))
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


def test_the_context_is_the_smallest_length_key_capped_by_the_tokenizer_config() -> None:
    assert derived_context({"max_position_embeddings": 4096, "n_positions": 1024}, {}) == (
        1024,
        "n_positions in config.json",
    )
    assert derived_context({"max_position_embeddings": 4096}, {"model_max_length": 2048}) == (
        2048,
        "model_max_length in tokenizer_config.json",
    )
    # a tokenizer that says nothing (Hugging Face's "unset" is a huge number) changes nothing
    assert derived_context({"seq_length": 8192}, {"model_max_length": 10**30})[0] == 8192
    nested = {"text_config": {"max_position_embeddings": 32768}, "max_position_embeddings": 1}
    assert derived_context(nested, {})[0] == 32768


def test_rope_scaling_stretches_the_context_as_vllm_does() -> None:
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert derived_context(linear, {})[0] == 16384
    llama3 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3"}}
    assert (
        derived_context({**llama3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, {})[0]
        == 131072
    )
    yarn = {
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    assert derived_context(yarn, {})[0] == 131072


def test_a_config_without_a_length_gets_vllms_default_and_says_so() -> None:
    length, source = derived_context({"hidden_size": 8}, {})
    assert length == VLLM_DEFAULT_CONTEXT and "default" in source


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (lambda p: p / "absent", "does not exist"),
        (lambda p: (p / "file").write_text("x") and p / "file", "is not a directory"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "has no config.json"),
    ],
)
def test_a_model_that_is_not_a_model_directory_is_one_line(
    tmp_path: Path, setup: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says) as exc:
        read_model_dir(str(setup(tmp_path)))
    assert "\n" not in str(exc.value)


def test_a_model_without_a_tokenizer_is_refused_unless_none_is_needed(tmp_path: Path) -> None:
    folder = model(tmp_path, tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer"):
        read_model_dir(str(folder))
    assert read_model_dir(str(folder), needs_tokenizer=False).tokenizer is None
    elsewhere = tmp_path / "tok"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.model").write_bytes(b"\0")
    assert read_model_dir(str(folder), str(elsewhere)).tokenizer == elsewhere


def test_a_config_that_is_not_json_names_its_file(tmp_path: Path) -> None:
    folder = model(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json does not read as JSON"):
        read_model_dir(str(folder))


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.sampled_from([32, 64, 128]),
    st.integers(1, 4),
    st.sampled_from([2, 4]),
)
def test_kv_bytes_per_token_agrees_with_the_calibrations(
    layers: int, kv_heads: int, head_dim: int, groups: int, dtype_bytes: int
) -> None:
    config = {
        "hidden_size": head_dim * kv_heads * groups,
        "num_attention_heads": kv_heads * groups,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "max_position_embeddings": 16,
    }
    ours = ModelDir(Path("."), 16, "", None, None, config)
    assert ours.kv_bytes_per_token(dtype_bytes) == kv_bytes_per_token(
        SimpleNamespace(**config), dtype_bytes
    )


def test_max_model_len_defaults_to_the_models_context(tmp_path: Path) -> None:
    fit = fit_vllm_options({"model": str(model(tmp_path))}, on_cpu=True)
    assert fit.options["max_model_len"] == 2048
    assert fit.notes[0].endswith("context 2048 tokens (max_position_embeddings in config.json), "
                                 "vocabulary 1024")  # fmt: skip
    assert fit.notes[1] == "max_model_len 2048 (the model's context)"


def test_max_model_len_is_capped_where_the_kv_cache_holds_less_and_says_so(
    tmp_path: Path,
) -> None:
    folder = model(tmp_path, max_position_embeddings=32768)
    # 1 KiB a token (2 layers x 1 KV head x 64 x fp32 x K,V): 4 MiB is 32 blocks of 128, one
    # of which vLLM keeps back
    fit = fit_vllm_options({"model": str(folder), "kv_cache_memory_bytes": 4 << 20}, on_cpu=True)
    assert fit.options["max_model_len"] == 31 * 128
    assert "capped: the KV cache (4 MiB at 1024 B a token) holds 3968 of its 32768" in fit.notes[1]
    # a GPU sizes its cache at start: nothing to cap by before it
    assert fit_vllm_options({"model": str(folder)}, on_cpu=False).options["max_model_len"] == 32768


def test_a_given_max_model_len_is_kept_or_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = str(model(tmp_path))
    assert (
        fit_vllm_options({"model": folder, "max_model_len": 1024}, on_cpu=True).options[
            "max_model_len"
        ]
        == 1024
    )
    with pytest.raises(ValueError, match="longer than the model's context, 2048 tokens"):
        fit_vllm_options({"model": folder, "max_model_len": 4096}, on_cpu=True)
    with pytest.raises(ValueError, match="does not fit: the KV cache"):
        fit_vllm_options(
            {"model": folder, "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 20},
            on_cpu=True,
        )
    with pytest.raises(ValueError, match="give a number of tokens"):
        fit_vllm_options({"model": folder, "max_model_len": 0}, on_cpu=True)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert (
        fit_vllm_options({"model": folder, "max_model_len": 4096}, on_cpu=True).options[
            "max_model_len"
        ]
        == 4096
    )


@given(st.integers(1, 1 << 16), st.integers(1, 1 << 26), st.sampled_from([16, 128]))
def test_the_fitted_length_never_passes_the_context_or_the_kv_cache(
    context: int, kv_bytes: int, block: int
) -> None:
    info = ModelDir(Path("m"), context, "", 512, None, LLAMA)
    options = {"kv_cache_memory_bytes": kv_bytes, "block_size": block}
    room = kv_room(info, options, True, 0)
    assert room is not None
    try:
        fit = fit_max_model_len(info, options, room)
    except ValueError as exc:
        assert room.tokens < 1 and "raise kv_cache_memory_bytes" in str(exc)
        return
    chosen = fit.options["max_model_len"]
    assert 1 <= chosen <= context and chosen <= room.tokens
    assert chosen == min(context, room.tokens)


def test_vllms_validation_error_keeps_its_reason_in_one_line() -> None:
    from pydantic import BaseModel, field_validator

    class ModelConfig(BaseModel):
        max_model_len: int

        @field_validator("max_model_len")
        @classmethod
        def fits(cls, value: int) -> int:
            raise ValueError(
                f"User-specified max_model_len ({value}) is greater than the derived "
                "max_model_len (max_position_embeddings=2048.0 in model's config.json)."
            )

    with pytest.raises(ValueError) as exc:
        ModelConfig(max_model_len=4096)
    assert str(exc.value).splitlines()[0] == "1 validation error for ModelConfig"  # the old line
    reason = startup_reason(exc.value)
    assert reason == (
        "ModelConfig: max_model_len: User-specified max_model_len (4096) is greater than the "
        "derived max_model_len (max_position_embeddings=2048.0 in model's config.json)."
    )
    assert startup_reason(RuntimeError("Engine core\ninitialization failed")) == (
        "RuntimeError: Engine core initialization failed"
    )
