"""The second tiny model the real-vLLM tests run on: unlike the one ``zl-bench tiny-model``
writes (32,768 positions, 512 tokens), a user's own, with a shorter context and another
vocabulary, which every command must fit (built offline by ``bench.tinymodel``)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

SHORT_MODEL_CONTEXT: Final = 2048
SHORT_MODEL_VOCAB: Final = 1024


def write_short_model(folder: Path) -> Path:
    """Write the short model into ``folder`` (needs ``tokenizers`` and ``safetensors``)."""
    from bench.tinymodel import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(
        vocab_size=SHORT_MODEL_VOCAB, max_position_embeddings=SHORT_MODEL_CONTEXT, seed=3
    )
    return write_tiny_model(folder, spec)


class BpeLikeRule:
    """A stand-in tokenizer at 1.32 bytes a token, like the tiny model's BPE."""

    name = "tokenizer:bpe-like"

    def count(self, text: str) -> int:
        return max(1, round(len(text) / 1.32))

    def text(self, tokens: int, seed: int) -> str:
        return "x" * round(tokens * 1.32)
