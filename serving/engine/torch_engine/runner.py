"""Runs one engine step on the model: builds the batch, picks eager or CUDA graph, samples greedily.

Synchronous on purpose: the engine calls ``execute`` from its worker thread, and the calibration
command calls it directly to time steps the way the engine runs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from serving.engine.torch_engine.kv_contiguous import ContiguousKVStore
from serving.engine.torch_engine.kv_paged import PagedKVPool
from serving.engine.torch_engine.model import LlamaForCausalLM
from serving.engine.torch_engine.step import SeqSlice

ALLOCATOR_REFRESH_S = 0.05


def _bucket(n: int, limit: int) -> int:
    """The next power of two at or above ``n``, capped at ``limit``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, limit)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: Tensor
    positions: Tensor
    slots: Tensor
    tables: Tensor
    out: Tensor


class DecodeGraphs:
    """CUDA graphs of decode-only steps over the paged pool, one per (batch, table width) bucket.

    Captured lazily on first use, in one shared memory pool; padded rows read and write the
    pool's scratch block.
    """

    def __init__(
        self, model: LlamaForCausalLM, pool: PagedKVPool, max_batch: int, max_blocks: int
    ) -> None:
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def run(self, slices: list[SeqSlice]) -> list[int]:
        batch = _bucket(len(slices), self.max_batch)
        width = _bucket(max(len(s.block_table) for s in slices), self.max_blocks)
        entry = self.graphs.get((batch, width)) or self._capture(batch, width)
        scratch = self.pool.scratch_block
        n = len(slices)
        ids = torch.zeros(batch, dtype=torch.long)
        positions = torch.zeros(batch, dtype=torch.long)
        slots = torch.full((batch,), scratch * self.pool.block_size, dtype=torch.long)
        tables = torch.full((batch, width), scratch, dtype=torch.long)
        for i, s in enumerate(slices):
            ids[i] = s.token_ids[0]
            positions[i] = s.start
            slots[i] = self.pool.slot(s.block_table, s.start)
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        entry.input_ids.copy_(ids)
        entry.positions.copy_(positions)
        entry.slots.copy_(slots)
        entry.tables.copy_(tables)
        entry.graph.replay()
        return entry.out[:n].tolist()

    def _capture(self, batch: int, width: int) -> _Graph:
        device = self.pool.device
        scratch = self.pool.scratch_block
        ids = torch.zeros(batch, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        slots = torch.full(
            (batch,), scratch * self.pool.block_size, dtype=torch.long, device=device
        )
        tables = torch.full((batch, width), scratch, dtype=torch.long, device=device)

        def forward() -> Tensor:
            attn = self.pool.decode_attention(tables, positions, slots)
            return self.model(ids, positions, attn).argmax(-1)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = forward()
        entry = _Graph(graph, ids, positions, slots, tables, out)
        self.graphs[(batch, width)] = entry
        return entry


class ModelRunner:
    """The model, its KV store, and (on CUDA, paged layout) the decode graphs."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        store: PagedKVPool | ContiguousKVStore,
        max_batch: int,
        max_blocks: int,
        cuda_graphs: bool,
    ) -> None:
        self.model = model
        self.store = store
        self.device = store.device
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda" and isinstance(store, PagedKVPool):
            self.graphs = DecodeGraphs(model, store, max_batch, max_blocks)
        self._allocator: dict[str, float] = {}
        self._allocator_at = 0.0

    def execute(self, slices: list[SeqSlice]) -> list[int | None]:
        """Run one step; the greedy next token for each slice that samples, else None."""
        decode = [s for s in slices if len(s.token_ids) == 1]
        prefill = [s for s in slices if len(s.token_ids) > 1]
        if self.graphs is not None and not prefill:
            tokens: list[int | None] = list(self.graphs.run(decode))
        else:
            tokens = self._eager(decode, prefill)
        by_id = {s.seq_id: t for s, t in zip(decode + prefill, tokens, strict=True)}
        self._refresh_allocator()
        return [by_id[s.seq_id] if s.sample else None for s in slices]

    def _eager(self, decode: list[SeqSlice], prefill: list[SeqSlice]) -> list[int | None]:
        ordered = decode + prefill
        device = self.device
        ids = [t for s in ordered for t in s.token_ids]
        positions = [s.start + i for s in ordered for i in range(len(s.token_ids))]
        ends: list[int] = []
        row = 0
        for s in ordered:
            row += len(s.token_ids)
            ends.append(row - 1)
        attn = self.store.attention(decode, prefill)
        logits = self.model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            attn,
            torch.tensor(ends, device=device),
        )
        return list(logits.argmax(-1).tolist())

    def _refresh_allocator(self) -> None:
        now = time.monotonic()
        if now - self._allocator_at < ALLOCATOR_REFRESH_S:
            return
        self._allocator_at = now
        self._allocator = allocator_figures(self.device)

    @property
    def allocator(self) -> dict[str, float]:
        """The latest allocator figures (refreshed after steps, at most every 50 ms), KV bytes."""
        return {**self._allocator, "kv_bytes": float(self.store.nbytes)}


def allocator_figures(device: torch.device) -> dict[str, float]:
    """Caching-allocator figures on CUDA (fragmentation: inactive split / reserved bytes)."""
    figures: dict[str, float] = {}
    if device.type != "cuda":
        return figures
    stats = torch.cuda.memory_stats(device)
    reserved = float(stats.get("reserved_bytes.all.current", 0))
    inactive = float(stats.get("inactive_split_bytes.all.current", 0))
    figures.update(
        reserved_bytes=reserved,
        allocated_bytes=float(stats.get("allocated_bytes.all.current", 0)),
        inactive_split_bytes=inactive,
        inactive_split_bytes_peak=float(stats.get("inactive_split_bytes.all.peak", 0)),
        num_alloc_retries=float(stats.get("num_alloc_retries", 0)),
        num_ooms=float(stats.get("num_ooms", 0)),
        fragmentation=inactive / reserved if reserved else 0.0,
    )
    return figures
