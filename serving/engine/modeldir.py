"""A model directory as the suite reads it before any engine starts: its context length,
vocabulary and tokenizer, and the engine settings fitted to them (:func:`fit_vllm_options`).

People bring their own models (contexts from 2k to 128k, their own tokenizers), so every command
that takes ``model=DIR`` plans inside the model's own limits and refuses in one line what vLLM
would refuse tens of seconds into its start. The context is derived as vLLM derives it
(``vllm.config.model._get_and_verify_max_len``): the smallest of the length keys of
``config.json`` (its ``text_config`` for a multimodal model), ``model_max_length`` there over
them, capped by ``tokenizer_config.json``'s ``model_max_length``, scaled by a RoPE scaling
factor (not for ``su``, ``longrope`` or ``llama3``; ``yarn`` from its original length), and 2048
where the config names no length. Nothing here imports vLLM or transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# vLLM's keys for a model's length, in its order (``derive_max_model_len_and_key``).
CONTEXT_KEYS: Final = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
VLLM_DEFAULT_CONTEXT: Final = 2048  # vLLM's assumption when config.json names no length
UNSCALED_ROPE: Final = ("su", "longrope", "llama3")
# Files one of which a Hugging Face tokenizer is loaded from (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# vLLM's CPU backend: its KV block when none is asked for, and its KV space variable (GiB).
CPU_BLOCK_SIZE: Final = 128
GPU_BLOCK_SIZE: Final = 16
CPU_KV_SPACE_ENV: Final = "VLLM_CPU_KVCACHE_SPACE"
ALLOW_LONG_ENV: Final = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
DTYPE_BYTES: Final = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from the model directory; ValueError naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"model file {path} does not read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {path} is not a JSON object")
    return data


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's own config (``text_config`` of a multimodal model)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _length(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _rope_scaled(config: Mapping[str, Any], length: int, key: str) -> tuple[int, str]:
    """``length`` scaled by the config's RoPE scaling, as vLLM scales its derived length."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(rope, dict) or "gemma3" in str(config.get("model_type", "")):
        return length, key
    kind = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor") or 1.0
    if kind in UNSCALED_ROPE or factor == 1.0:
        return length, key
    if kind == "yarn" and _length(rope.get("original_max_position_embeddings")):
        length = int(rope["original_max_position_embeddings"])
    return int(length * float(factor)), f"{key} x rope factor {factor}"


def derived_context(
    config: Mapping[str, Any], tokenizer_config: Mapping[str, Any]
) -> tuple[int, str]:
    """The model's context in tokens as vLLM derives it, and where it comes from."""
    text = _text_config(config)
    found = [(n, k) for k in CONTEXT_KEYS if (n := _length(text.get(k))) is not None]
    if _length(text.get("model_max_length")):
        found = [(int(text["model_max_length"]), "model_max_length")]
    if not found:
        return VLLM_DEFAULT_CONTEXT, "vLLM's default: config.json names no length"
    length, key = min(found)
    source = f"{key} in config.json"
    from_tokenizer = _length(tokenizer_config.get("model_max_length"))
    if from_tokenizer is not None and from_tokenizer < length:
        length, source = from_tokenizer, "model_max_length in tokenizer_config.json"
    return _rope_scaled(text, length, source)


def _tokenizer_dir(folder: Path) -> Path | None:
    """``folder`` when it holds a tokenizer's files, else None."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return folder
    return folder if any(folder.glob("*.tiktoken")) else None


@dataclass(frozen=True)
class ModelDir:
    """What a model directory says of its limits: its context (and where that comes from), its
    vocabulary, where its tokenizer is (None: it has none), and its ``config.json``."""

    path: Path
    context: int
    context_source: str
    vocab_size: int | None
    tokenizer: Path | None
    config: Mapping[str, Any]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int | None:
        """K and V of every layer for one token (None where the config lacks the shape)."""
        text = _text_config(self.config)
        heads, layers = (
            _length(text.get("num_attention_heads")),
            _length(text.get("num_hidden_layers")),
        )
        hidden = _length(text.get("hidden_size"))
        if not (heads and layers and hidden):
            return None
        kv_heads = _length(text.get("num_key_value_heads")) or heads
        head_dim = _length(text.get("head_dim")) or hidden // heads
        return 2 * layers * kv_heads * head_dim * dtype_bytes

    def dtype_bytes(self, dtype: str | None) -> int:
        """Bytes per KV element at ``dtype`` (``auto`` or unset: the config's ``torch_dtype``)."""
        if dtype in (None, "auto"):
            dtype = str(self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")
        return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)

    def describe(self) -> str:
        vocab = "unknown" if self.vocab_size is None else str(self.vocab_size)
        return (
            f"model {self.path}: context {self.context} tokens ({self.context_source}), "
            f"vocabulary {vocab}"
        )


def read_model_dir(
    model: str, tokenizer: str | None = None, *, needs_tokenizer: bool = True
) -> ModelDir:
    """The model directory ``model`` (with its tokenizer from ``tokenizer`` when given);
    ValueError, one line, for one that is missing, not a directory, has no ``config.json``, or
    has no tokenizer where one is needed."""
    if not model:
        raise ValueError(
            "the vllm engine needs --engine-option model=DIR (zl-bench tiny-model writes one)"
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model} does not exist (model=DIR: a local model directory)")
    if not path.is_dir():
        raise ValueError(f"model {model} is not a directory (model=DIR: a local model directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model} has no config.json: not a Hugging Face model directory")
    config = _read_json(path / "config.json")
    folder = Path(tokenizer).expanduser() if tokenizer else path
    found = _tokenizer_dir(folder) if folder.is_dir() else None
    if found is None and needs_tokenizer:
        raise ValueError(
            f"model {model} has no tokenizer ({' or '.join(TOKENIZER_FILES)} in {folder}); give "
            "--engine-option tokenizer=DIR, or skip_tokenizer_init=true to send token ids"
        )
    tokenizer_config = folder / "tokenizer_config.json"
    extra = _read_json(tokenizer_config) if tokenizer_config.is_file() else {}
    context, source = derived_context(config, extra)
    text = _text_config(config)
    return ModelDir(path, context, source, _length(text.get("vocab_size")), found, config)


@dataclass(frozen=True)
class ModelFit:
    """Engine options fitted to a model: the options with what was derived set, the model
    directory read (None for an engine without one) and one line per thing adapted."""

    options: dict[str, Any]
    model: ModelDir | None = None
    notes: tuple[str, ...] = ()


def no_model(options: Mapping[str, Any]) -> ModelFit:
    """An engine that serves no model directory: its options as they are."""
    return ModelFit(dict(options))


@dataclass(frozen=True)
class KvRoom:
    """How many tokens of one sequence the engine's KV cache holds, where its size is known
    before the engine starts (an explicit size, or the CPU build's default)."""

    tokens: int
    bytes: int
    per_token: int

    def text(self) -> str:
        size = f"{self.bytes / 2**20:.0f} MiB" if self.bytes >= 2**20 else f"{self.bytes} B"
        return f"the KV cache ({size} at {self.per_token} B a token) holds {self.tokens}"


def kv_room(
    model: ModelDir, options: Mapping[str, Any], on_cpu: bool, cpu_kv_bytes: int
) -> KvRoom | None:
    """Tokens the KV cache holds, less the block vLLM keeps back, in whole blocks; None where
    the cache is sized at start (a GPU's ``gpu_memory_utilization``)."""
    per_token = model.kv_bytes_per_token(
        model.dtype_bytes(options.get("dtype") or ("float32" if on_cpu else None))
    )
    block = int(options.get("block_size") or (CPU_BLOCK_SIZE if on_cpu else GPU_BLOCK_SIZE))
    if per_token is None:
        return None
    if options.get("num_gpu_blocks_override"):
        blocks = int(options["num_gpu_blocks_override"])
        return KvRoom((blocks - 1) * block, blocks * block * per_token, per_token)
    size = options.get("kv_cache_memory_bytes")
    if on_cpu and os.environ.get(CPU_KV_SPACE_ENV):
        size = int(os.environ[CPU_KV_SPACE_ENV]) * 2**30
    if size is None and on_cpu:
        size = cpu_kv_bytes
    if size is None:
        return None
    blocks = int(size) // (block * per_token)
    return KvRoom(max(0, blocks - 1) * block, int(size), per_token)


def fit_max_model_len(model: ModelDir, options: Mapping[str, Any], room: KvRoom | None) -> ModelFit:
    """``max_model_len`` fitted to the model: unset, the model's context (capped where the KV
    cache holds less, and said); given, refused where it passes the context (unless vLLM is
    told to allow it) or what the KV cache holds."""
    given = options.get("max_model_len")
    notes = [model.describe()]
    if given is not None:
        if int(given) < 1:
            raise ValueError(
                f"max_model_len {given}: give a number of tokens (unset: the model's context)"
            )
        if int(given) > model.context and not os.environ.get(ALLOW_LONG_ENV):
            raise ValueError(
                f"max_model_len {given} is longer than the model's context, {model.context} "
                f"tokens ({model.context_source}) of {model.path}; leave it unset for the "
                "model's own"
            )
        if room is not None and int(given) > room.tokens:
            raise ValueError(
                f"max_model_len {given} does not fit: {room.text()} tokens of {model.path}; "
                "lower max_model_len or raise kv_cache_memory_bytes"
            )
        return ModelFit(dict(options), model, (*notes, f"max_model_len {given}, as given"))
    chosen, why = model.context, "the model's context"
    if room is not None and room.tokens < chosen:
        if room.tokens < 1:
            raise ValueError(f"{room.text()} tokens of {model.path}: raise kv_cache_memory_bytes")
        chosen, why = room.tokens, f"capped: {room.text()} of its {model.context}"
    notes.append(f"max_model_len {chosen} ({why})")
    return ModelFit({**options, "max_model_len": chosen}, model, tuple(notes))
