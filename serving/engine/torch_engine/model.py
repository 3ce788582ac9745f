"""A Llama-shaped decoder in plain PyTorch: RMSNorm, RoPE (llama3 scaling), GQA attention, SwiGLU.

The model knows nothing about how KV is stored: each layer hands its new keys and values to an
``Attention`` object built per step by the KV layout (paged pool or contiguous tensors), which
stores them and returns the attention output. Parameter names follow Hugging Face's
``LlamaForCausalLM`` so a local safetensors checkpoint loads without renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict, Unpack

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LlamaShape:
    """The figures that define a Llama model's shape (as in its Hugging Face config.json)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    rope_scaling_factor: float | None = None
    original_max_position: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def params(self) -> int:
        """All parameters, embedding and lm_head counted separately (as the shared profile does)."""
        h, d = self.hidden_size, self.head_dim
        attn = 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + h + 2 * self.vocab_size * h

    @property
    def non_embedding_params(self) -> int:
        """Parameters a decode step reads (everything but the embedding table)."""
        return self.params - self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


SHAPES: dict[str, LlamaShape] = {
    "llama-3.2-1b": LlamaShape(
        "llama-3.2-1b", 2048, 16, 32, 8, 8192, 128_256, rope_scaling_factor=32.0
    ),
    "llama-3.1-8b": LlamaShape(
        "llama-3.1-8b", 4096, 32, 32, 8, 14_336, 128_256, rope_scaling_factor=8.0
    ),
    "tiny": LlamaShape("tiny", 64, 2, 4, 2, 128, 4096, rope_theta=10_000.0),
}


def get_shape(name: str) -> LlamaShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}") from None


class Attention(Protocol):
    """Stores one layer's new K/V for the step's tokens and attends over each sequence's context."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d]; returns [T, heads, d]."""
        ...


def rope_tables(shape: LlamaShape, max_positions: int, device: torch.device) -> Tensor:
    """cos and sin per position, [2, max_positions, head_dim], with Llama 3's frequency scaling."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if shape.rope_scaling_factor is not None:
        low_freq_wavelen = shape.original_max_position / 1.0
        high_freq_wavelen = shape.original_max_position / 4.0
        wavelen = 2 * math.pi / inv_freq
        smooth = (shape.original_max_position / wavelen - 1.0) / (4.0 - 1.0)
        scaled = inv_freq / shape.rope_scaling_factor
        mid = (1 - smooth) * scaled + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > low_freq_wavelen,
            scaled,
            torch.where(wavelen < high_freq_wavelen, inv_freq, mid),
        )
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()]).to(device=device, dtype=torch.float32)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, d]; cos, sin: [T, d]."""
    xf = x.float()
    out = xf * cos[:, None, :] + _rotate_half(xf) * sin[:, None, :]
    return out.to(x.dtype)


class Factory(TypedDict):
    """Where and in what precision a module's parameters are created."""

    device: torch.device
    dtype: torch.dtype


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Unpack[Factory]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, shape: LlamaShape, **factory: Unpack[Factory]) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False, **factory)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False, **factory)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False, **factory)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False, **factory)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attn: Attention) -> Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        return self.o_proj(attn(layer, q, k, v).reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, shape: LlamaShape, **factory: Unpack[Factory]) -> None:
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, **factory)
        self.up_proj = nn.Linear(h, i, bias=False, **factory)
        self.down_proj = nn.Linear(i, h, bias=False, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, **factory: Unpack[Factory]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **factory)
        self.self_attn = LlamaAttention(shape, **factory)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **factory)
        self.mlp = LlamaMLP(shape, **factory)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attn: Attention) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, shape: LlamaShape, **factory: Unpack[Factory]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, **factory)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(shape, **factory) for _ in range(shape.num_layers)]
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, **factory)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head; ``forward`` runs one engine step over a ragged token batch."""

    rope: Tensor  # a buffer: (cos, sin) tables by position

    def __init__(
        self, shape: LlamaShape, max_positions: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.shape = shape
        factory = Factory(device=device, dtype=dtype)
        self.model = LlamaModel(shape, **factory)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, **factory)
        self.register_buffer("rope", rope_tables(shape, max_positions, device), persistent=False)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor, positions: Tensor, attn: Attention, rows: Tensor | None = None
    ) -> Tensor:
        """Logits (float32) for the token rows in ``rows`` (all rows when None)."""
        cos, sin = self.rope[0][positions], self.rope[1][positions]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, attn)
        if rows is not None:
            x = x[rows]
        return self.lm_head(self.model.norm(x)).float()


def build_model(
    shape: LlamaShape,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    weights_path: str | None = None,
) -> LlamaForCausalLM:
    """Random weights from ``seed`` (deterministic), or a local safetensors checkpoint."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape, max_positions, device, dtype)
    if weights_path is not None:
        load_safetensors(model, weights_path)
    return model.eval()


def load_safetensors(model: LlamaForCausalLM, path: str) -> None:
    """Load a local ``*.safetensors`` file or directory; a missing lm_head is tied to the embedding.

    Never downloads: ``path`` must exist on disk.
    """
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path}")
    expected = dict(model.state_dict())
    device = next(model.parameters()).device
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            for name, tensor in load_file(str(file), device=str(device)).items():
                if name not in expected:
                    continue
                if expected[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint {tuple(tensor.shape)} vs model "
                        f"{tuple(expected[name].shape)}"
                    )
                expected[name].copy_(tensor)
                loaded.add(name)
        if "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
            loaded.add("lm_head.weight")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
