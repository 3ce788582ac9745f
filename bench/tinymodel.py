"""``zl-bench tiny-model``: a tiny Llama-architecture model directory, built offline.

The real-engine tests and smoke runs need a model vLLM will load, and nothing may come from a
model hub. So this writes one from nothing: ``config.json`` (Llama, hidden 128, 2 heads, 1 KV
head, head_dim 64 - the CPU attention kernels refuse head_dim 16 - 2 layers), seeded random
weights as safetensors, and a byte-level BPE tokenizer trained here on generated text, saved in
the Hugging Face layout (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) so ``transformers.AutoTokenizer`` and vLLM load it. The weights are
noise: the model is for serving mechanics and timing, not for text quality.

Needs ``numpy``, ``safetensors`` and ``tokenizers`` (the ``vllm`` extra brings all three).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.outputs import output_dir

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK, BOS, EOS)
# Words the training text is drawn from: enough variety for the BPE merges to fill the vocab.
_WORDS_TEXT = (
    "the a an of to in and or for with on at by from as is are was be this that it serve "
    "request token stream prompt replica engine scheduler queue batch cache block decode "
    "prefill latency throughput tenant session priority deadline abort retry model layer "
    "head hidden vector matrix attention kernel memory budget chaos fault network packet "
    "frame header window flow control zero one two three four five six seven eight nine "
    "hundred thousand quick brown fox jumps over lazy dog river mountain cloud signal noise"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """The model's shape; the defaults are the smallest the CPU vLLM kernels accept."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 1
    num_layers: int = 2
    intermediate_size: int = 256
    # Profile C's largest prompts (32 kB at seed scale) are about 0.76 of this tokenizer's tokens
    # a byte; rotary positions cost nothing until used.
    max_position_embeddings: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden size must be a multiple of the head count")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("the head count must be a multiple of the KV head count")
        if self.vocab_size < 300:
            raise ValueError("vocab size must be at least 300 (256 bytes + specials + merges)")
        if self.max_position_embeddings < 1:
            raise ValueError("the context must be at least one token")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def training_text(seed: int, sentences: int = 4000) -> list[str]:
    """Seeded sentences of words and numbers: the tokenizer's whole training corpus."""
    rng = np.random.default_rng(seed)
    vocabulary = _WORDS_TEXT.split()
    lines = []
    for _ in range(sentences):
        picks = rng.integers(0, len(vocabulary), rng.integers(4, 16))
        words = [vocabulary[i] for i in picks]
        words.append(str(int(rng.integers(0, 10_000))))
        lines.append(" ".join(words).capitalize() + ".")
    return lines


def train_tokenizer(spec: TinyModelSpec) -> Any:
    """A byte-level BPE (any text encodes, no unknowns) with no added BOS/EOS.

    No post-processor adds special tokens, so a prompt's token count is the count of its BPE
    pieces, the same in ``tokenizers``, ``transformers`` and vLLM.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(spec.seed), trainer=trainer)
    return tokenizer


def model_config(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM`` at this shape."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
    }


def random_weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights under the Hugging Face Llama names; norms start at one."""
    rng = np.random.default_rng(spec.seed)
    hidden, inner = spec.hidden_size, spec.intermediate_size
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    weights = {"model.embed_tokens.weight": dense(vocab_size, hidden)}
    for i in range(spec.num_layers):
        layer = f"model.layers.{i}"
        weights |= {
            f"{layer}.self_attn.q_proj.weight": dense(q_out, hidden),
            f"{layer}.self_attn.k_proj.weight": dense(kv_out, hidden),
            f"{layer}.self_attn.v_proj.weight": dense(kv_out, hidden),
            f"{layer}.self_attn.o_proj.weight": dense(hidden, q_out),
            f"{layer}.mlp.gate_proj.weight": dense(inner, hidden),
            f"{layer}.mlp.up_proj.weight": dense(inner, hidden),
            f"{layer}.mlp.down_proj.weight": dense(hidden, inner),
            f"{layer}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{layer}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    weights["lm_head.weight"] = dense(vocab_size, hidden)
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_tiny_model(out: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the model directory at ``out`` (created if needed) and return it."""
    from safetensors.numpy import save_file

    spec = spec or TinyModelSpec()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec)
    vocab_size = tokenizer.get_vocab_size()
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    _write_json(out / "special_tokens_map.json", specials)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            **specials,
        },
    )
    _write_json(out / "config.json", model_config(spec, vocab_size, bos_id, eos_id))
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    save_file(random_weights(spec, vocab_size), str(out / "model.safetensors"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench tiny-model``'s arguments."""
    default = TinyModelSpec()
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=default.seed, help="weights and corpus seed")
    parser.add_argument("--vocab-size", type=int, default=default.vocab_size, help="BPE vocab")
    parser.add_argument("--layers", type=int, default=default.num_layers, help="decoder layers")
    parser.add_argument(
        "--context",
        type=int,
        default=default.max_position_embeddings,
        help="the model's context in tokens (max_position_embeddings)",
    )


def run_command(args: argparse.Namespace) -> int:
    """Write the model; a bad shape is a ValueError, which ``zl-bench`` reports as a usage error."""
    output_dir(args.out)
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"tiny-model needs tokenizers and safetensors (pip install '.[vllm]'): {exc}"
        ) from None
    spec = TinyModelSpec(
        vocab_size=args.vocab_size,
        num_layers=args.layers,
        max_position_embeddings=args.context,
        seed=args.seed,
    )
    out = write_tiny_model(output_dir(args.out), spec)
    print(
        f"wrote {out} (LlamaForCausalLM, {spec.num_layers} layers, head_dim {spec.head_dim}, "
        f"context {spec.max_position_embeddings}, vocabulary {spec.vocab_size})"
    )
    return 0
