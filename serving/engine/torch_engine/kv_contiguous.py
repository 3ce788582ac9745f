"""The contiguous KV layout, as pre-paging servers kept it: one growing tensor per sequence.

Each sequence owns one ``[layers, 2, capacity, kv_heads, head_dim]`` tensor from PyTorch's caching
allocator. When a step needs more room the tensor is replaced by one twice as large (the old
contents copied over), so sequences of mixed, growing lengths leave split, partly-used segments
in the allocator: the fragmentation that ``torch.cuda.memory_stats()`` shows and paging avoids.
Attention runs per sequence over its own tensor, since no two sequences share storage.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from serving.engine.torch_engine.model import LlamaShape
from serving.engine.torch_engine.step import SeqSlice

MIN_CAPACITY = 16


class ContiguousStepAttention:
    """The Attention of one step: each sequence writes to and reads from its own tensor."""

    def __init__(self, entries: list[tuple[slice, Tensor, int, Tensor | None]]) -> None:
        self.entries = entries

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        for rows, cache, start, mask in self.entries:
            n = rows.stop - rows.start
            cache[layer, 0, start : start + n] = k[rows]
            cache[layer, 1, start : start + n] = v[rows]
            qs = q[rows].transpose(0, 1)[None]
            ks = cache[layer, 0, : start + n].transpose(0, 1)[None]
            vs = cache[layer, 1, : start + n].transpose(0, 1)[None]
            causal = mask is None and n > 1
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            out[rows] = o[0].transpose(0, 1)
        return out


class ContiguousKVStore:
    """Per-sequence tensors; touched only by the step that runs or between steps, never both."""

    def __init__(self, shape: LlamaShape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.tensors: dict[str, Tensor] = {}

    @property
    def capacity_tokens(self) -> int:
        return sum(t.shape[2] for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def free(self, seq_id: str) -> None:
        """Drop the sequence's tensor; its memory goes back to the caching allocator."""
        self.tensors.pop(seq_id, None)

    def _ensure(self, seq_id: str, tokens: int) -> Tensor:
        """The sequence's tensor with room for ``tokens``, doubled (and copied) when too small."""
        old = self.tensors.get(seq_id)
        if old is not None and old.shape[2] >= tokens:
            return old
        capacity = max(tokens, MIN_CAPACITY, 2 * old.shape[2] if old is not None else 0)
        shape = self.shape
        size = (shape.num_layers, 2, capacity, shape.num_kv_heads, shape.head_dim)
        new = torch.empty(size, device=self.device, dtype=self.dtype)
        if old is not None:
            new[:, :, : old.shape[2]] = old
        self.tensors[seq_id] = new
        return new

    def attention(self, decode: list[SeqSlice], prefill: list[SeqSlice]) -> ContiguousStepAttention:
        """The step's Attention, growing tensors as needed; rows are decode first, then prefill."""
        entries: list[tuple[slice, Tensor, int, Tensor | None]] = []
        row = 0
        for s in decode + prefill:
            n = len(s.token_ids)
            cache = self._ensure(s.seq_id, s.start + n)
            mask = None
            if n > 1 and s.start > 0:
                keys = torch.arange(s.start + n, device=self.device)
                pos = s.start + torch.arange(n, device=self.device)
                mask = keys[None, :] <= pos[:, None]
            entries.append((slice(row, row + n), cache, s.start, mask))
            row += n
        return ContiguousStepAttention(entries)
