"""The paged KV layout, as vLLM's: one preallocated block pool, one block table per sequence.

The pool is ``[layers, num_blocks + 1, block_size, kv_heads, head_dim]`` for K and for V. The
block ids come from :class:`serving.engine.kv.KVBlockManager` (the same bookkeeping the sim
uses); the extra last block is a scratch block that padded rows of a CUDA-graph batch write into,
so padding never touches a live sequence. Attention gathers each sequence's blocks into a padded
``[S, K]`` view and runs one SDPA call per group (all decode rows together, each prefill chunk on
its own), which keeps every tensor shape a function of (batch, table width) for graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from serving.engine.torch_engine.model import LlamaShape
from serving.engine.torch_engine.step import SeqSlice


@dataclass(slots=True)
class _Group:
    """Sequences attended together: ``rows`` of the step's tokens viewed as [S, Q]."""

    rows: slice
    seqs: int
    queries: int
    tables: Tensor
    mask: Tensor


class PagedStepAttention:
    """The Attention of one step over the pool: write new K/V by slot, attend group by group."""

    def __init__(self, pool: PagedKVPool, slots: Tensor, groups: list[_Group]) -> None:
        self.pool = pool
        self.slots = slots
        self.groups = groups

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pool = self.pool
        kc, vc = pool.k[layer], pool.v[layer]
        kv_heads, d = kc.shape[-2], kc.shape[-1]
        kc.view(-1, kv_heads, d).index_copy_(0, self.slots, k)
        vc.view(-1, kv_heads, d).index_copy_(0, self.slots, v)
        if len(self.groups) == 1:
            return self._attend(self.groups[0], q, kc, vc)
        out = torch.empty_like(q)
        for group in self.groups:
            out[group.rows] = self._attend(group, q[group.rows], kc, vc)
        return out

    @staticmethod
    def _attend(group: _Group, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        s, n = group.seqs, group.queries
        heads, d = q.shape[-2], q.shape[-1]
        qg = q.reshape(s, n, heads, d).transpose(1, 2)
        kg = kc[group.tables].flatten(1, 2).transpose(1, 2)
        vg = vc[group.tables].flatten(1, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(s * n, heads, d)


def causal_mask(starts: Tensor, queries: int, keys: int) -> Tensor:
    """[S, 1, Q, K] bool: query i of sequence s (at position starts[s] + i) sees keys <= it.

    Key 0 is always visible, so padded rows never produce NaN.
    """
    pos = starts[:, None] + torch.arange(queries, device=starts.device)[None, :]
    return (torch.arange(keys, device=starts.device)[None, None, :] <= pos[:, :, None])[:, None]


class PagedKVPool:
    """The preallocated pool and the per-step attention built on it."""

    def __init__(
        self,
        shape: LlamaShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        size = (shape.num_layers, num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)
        self.k = torch.zeros(size, device=device, dtype=dtype)
        self.v = torch.zeros(size, device=device, dtype=dtype)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.device = device

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def attention(self, decode: list[SeqSlice], prefill: list[SeqSlice]) -> PagedStepAttention:
        """The step's Attention; rows are ordered decode slices first, then each prefill chunk."""
        device = self.device
        slots: list[int] = []
        groups: list[_Group] = []
        row = 0
        if decode:
            width = max(len(s.block_table) for s in decode)
            tables = [
                s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in decode
            ]
            starts = torch.tensor([s.start for s in decode], device=device)
            slots.extend(self.slot(s.block_table, s.start) for s in decode)
            groups.append(self._group(row, len(decode), 1, tables, starts, width))
            row += len(decode)
        for s in prefill:
            n = len(s.token_ids)
            slots.extend(self.slot(s.block_table, s.start + i) for i in range(n))
            starts = torch.tensor([s.start], device=device)
            groups.append(self._group(row, 1, n, [s.block_table], starts, len(s.block_table)))
            row += n
        return PagedStepAttention(self, torch.tensor(slots, device=device), groups)

    def decode_attention(
        self, tables: Tensor, positions: Tensor, slots: Tensor
    ) -> PagedStepAttention:
        """A decode-only step from device tensors alone, so it can be captured in a CUDA graph."""
        batch, width = tables.shape
        mask = causal_mask(positions, 1, width * self.block_size)
        return PagedStepAttention(self, slots, [_Group(slice(0, batch), batch, 1, tables, mask)])

    def _group(
        self, row: int, seqs: int, queries: int, tables: list[list[int]], starts: Tensor, width: int
    ) -> _Group:
        table = torch.tensor(tables, device=self.device)
        mask = causal_mask(starts, queries, width * self.block_size)
        return _Group(slice(row, row + seqs * queries), seqs, queries, table, mask)
