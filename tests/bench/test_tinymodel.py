"""``zl-bench tiny-model``: the offline Llama directory the real-vLLM tests serve.

Needs ``tokenizers`` and ``safetensors`` (the ``vllm`` extra); the plain session skips without
them. Loading with ``transformers`` is checked where it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.vllm  # runs in ``nox -s vllm``, where its dependencies are

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install '.[vllm]')")
safetensors_numpy = pytest.importorskip(
    "safetensors.numpy", reason="safetensors is not installed (pip install '.[vllm]')"
)

from bench.cli import main as zl_bench  # noqa: E402
from bench.tinymodel import TinyModelSpec, write_tiny_model  # noqa: E402
from harness.profile import load_profile  # noqa: E402
from harness.workload import build_schedule  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_config_has_the_shape_the_cpu_kernels_accept(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64 == config["hidden_size"] // config["num_attention_heads"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["max_position_embeddings"] >= 2048
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tokenizer["model"]["vocab"]) == 512


def test_weights_match_the_config_and_the_seed(tmp_path: Path, model_dir: Path) -> None:
    weights = safetensors_numpy.load_file(str(model_dir / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (512, 128)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (64, 128)
    assert weights["lm_head.weight"].dtype == np.float32
    again = safetensors_numpy.load_file(str(write_tiny_model(tmp_path / "b") / "model.safetensors"))
    assert all(np.array_equal(weights[k], again[k]) for k in weights)
    other = write_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    other_weights = safetensors_numpy.load_file(str(other / "model.safetensors"))
    assert not np.array_equal(weights["lm_head.weight"], other_weights["lm_head.weight"])


def test_tokenizer_round_trips_any_text_without_special_tokens(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "The replica streams tokens; unseen: Zürich ✓ 42"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<s>") not in ids
    assert len(tokenizer.encode("the request token stream").ids) < len("the request token stream")


def test_transformers_loads_the_tokenizer(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.decode(tokenizer("a quick brown fox")["input_ids"]) == "a quick brown fox"


def test_cli_writes_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert zl_bench(["tiny-model", "--out", str(tmp_path / "m"), "--layers", "1"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1
    assert "LlamaForCausalLM" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        zl_bench(["tiny-model", "--out", str(tmp_path / "n"), "--vocab-size", "10"])
    assert bad.value.code == 2
    assert "vocab size" in capsys.readouterr().err


def test_the_short_model_has_its_own_context_and_vocabulary(short_model: Path) -> None:
    """The second model the vLLM tests run on (``tests.support.models``), written with the
    options ``zl-bench tiny-model --context --vocab-size`` takes."""
    from serving.engine.modeldir import read_model_dir

    config = json.loads((short_model / "config.json").read_text())
    assert (config["max_position_embeddings"], config["vocab_size"]) == (2048, 1024)
    read = read_model_dir(str(short_model))
    assert (read.context, read.vocab_size, read.tokenizer) == (2048, 1024, short_model)


def test_cli_writes_a_model_of_another_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert zl_bench(["tiny-model", "--out", str(tmp_path / "m"), "--context", "4096"]) == 0
    assert (
        json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 4096
    )
    assert "context 4096, vocabulary 512" in capsys.readouterr().out


CPU_SCALES = ("smoke", "laptop")


@pytest.mark.parametrize("scale", CPU_SCALES)
def test_every_profiles_largest_request_fits_the_models_positions(
    model_dir: Path, scale: str
) -> None:
    """Counted with the model's own tokenizer, as the vllm engine charges prompts. (The seed
    scale's 512 kB prompts of profile B are the GPU study's, not a tiny model's.)"""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    for name in ("a_latency", "b_high_concurrency", "c_mixed"):
        largest = {}
        for req in build_schedule(load_profile(name, scale, None)):
            if req.prompt_bytes > largest.get(req.request_class, (0, None))[0]:
                largest[req.request_class] = (req.prompt_bytes, req)
        for _, req in largest.values():
            tokens = len(tokenizer.encode(req.prompt()).ids) + req.max_tokens
            assert tokens <= positions, (name, scale, req.request_class, tokens)
