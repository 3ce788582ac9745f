"""The ``torch`` engine: continuous batching, as the sim does it, over a real PyTorch model.

Scheduling is the :class:`ContinuousBatcher` the sim also uses (running sequences first, one
token budget shared by decode and chunked prefill, ``max_num_seqs``, preemption by recompute when
KV blocks run out) over the same :class:`KVBlockManager` for admission in both KV layouts, so both
layouts see identical batches. The model runs in one worker thread, so the event loop keeps
serving while a step computes. The KV store is touched by the worker only while a step runs and by
the loop only between steps; an abort during a step frees its blocks at once and its tensors right
after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from serving.engine.batching import ContinuousBatcher, Sequence, StepLoop
from serving.engine.kv import KVBlockManager
from serving.engine.settings import EngineSettings, dtype_name
from serving.engine.streams import VOCAB_SIZE, detokenize
from serving.engine.torch_engine.kv_contiguous import ContiguousKVStore
from serving.engine.torch_engine.kv_paged import PagedKVPool
from serving.engine.torch_engine.model import build_model, get_shape
from serving.engine.torch_engine.prompt import prompt_token_ids
from serving.engine.torch_engine.runner import ModelRunner
from serving.engine.torch_engine.step import SeqSlice
from serving.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk

KV_LAYOUTS = ("paged", "contiguous")
CPU_DEFAULT_BLOCKS = 2048
CUDA_HEADROOM_BYTES = 4 << 30


@dataclass
class TorchEngineConfig:
    """Engine settings, named as vLLM and the sim name them; recorded in run metadata."""

    model_shape: str = "tiny"
    kv_layout: str = "paged"
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: int = 4096
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    weights_path: str | None = None
    seed: int = 0
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        get_shape(self.model_shape)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 on GPUs (as the profile was measured), float32 on CPU where bf16 matmuls crawl."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _TorchSeq(Sequence):
    """A sequence with its known token ids: the prompt, then what was sampled so far."""

    __slots__ = ("ids",)

    def __init__(self, request: EngineRequest, arrival: int, vocab_size: int) -> None:
        super().__init__(request, arrival)
        self.ids = prompt_token_ids(request, vocab_size)


def _text(ids: list[int]) -> str:
    """Chunk text: model vocabularies are larger than the token table, so ids wrap around it."""
    return detokenize([i % VOCAB_SIZE for i in ids])


class TorchEngine:
    """A real decoder behind the Engine protocol; see the module docstring."""

    name = "torch"

    def __init__(self, config: TorchEngineConfig | None = None) -> None:
        self.config = config = config or TorchEngineConfig()
        self.shape = get_shape(config.model_shape)
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        self.device, self.dtype = device, dtype
        self.model = build_model(
            self.shape, config.max_model_len, device, dtype, config.seed, config.weights_path
        )
        self.kv_bytes_per_token = self.shape.kv_bytes_per_token(dtype.itemsize)
        num_blocks = self._num_blocks(device)
        self.kv = KVBlockManager(num_blocks, config.block_size)
        store: PagedKVPool | ContiguousKVStore
        if config.kv_layout == "paged":
            store = PagedKVPool(self.shape, num_blocks, config.block_size, device, dtype)
        else:
            store = ContiguousKVStore(self.shape, device, dtype)
        self.store = store
        max_blocks = -(-config.max_model_len // config.block_size)
        self.runner = ModelRunner(
            self.model, store, config.max_num_seqs, max_blocks, config.cuda_graphs
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
        self._in_step = False
        self._deferred_frees: list[str] = []
        self._loop = StepLoop(self._run, "torch-engine")
        vocab_size = self.shape.vocab_size
        self.batcher: ContinuousBatcher[_TorchSeq] = ContinuousBatcher(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            new_seq=lambda request, arrival: _TorchSeq(request, arrival, vocab_size),
            text=_text,
            kick=self._loop.kick,
            on_release=self._free_tensors if isinstance(store, ContiguousKVStore) else None,
        )

    def _num_blocks(self, device: torch.device) -> int:
        """The explicit block count, else what fits in GPU memory after weights, else a default."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if device.type != "cuda":
            return CPU_DEFAULT_BLOCKS
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) - CUDA_HEADROOM_BYTES
        blocks = int(budget // (self.kv_bytes_per_token * config.block_size))
        if blocks < 1:
            raise ValueError(f"no GPU memory left for KV after loading {config.model_shape}")
        return blocks

    # -- public API -------------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        return self.batcher.stream(request)

    def abort(self, request_id: str) -> None:
        self.batcher.abort(request_id)

    @property
    def in_step(self) -> bool:
        """True while a step computes; tensors of sequences aborted meanwhile are freed after it."""
        return self._in_step

    def stats(self) -> EngineStats:
        stats = self.batcher.stats()
        stats.allocator = self.runner.allocator
        if isinstance(self.store, ContiguousKVStore):
            # Contiguous KV has no blocks: report token slots, so kv_waste is growth slack.
            stats.block_size = 1
            stats.kv_blocks_used = self.store.capacity_tokens
            stats.kv_blocks_total = self.kv.num_blocks * self.kv.block_size
        return stats

    def settings(self) -> EngineSettings:
        """What this engine runs with: its config, the KV blocks and dtype it settled on, chunked
        prefill (the batcher always chunks); no prefix cache."""
        config = self.config
        return EngineSettings(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            block_size=self.kv.block_size,
            kv_blocks=self.kv.num_blocks,
            prefix_caching=False,
            chunked_prefill=True,
            dtype=dtype_name(self.dtype),
        )

    async def close(self) -> None:
        self.batcher.close()
        await self._loop.stop()
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._in_step = False
        self.batcher.fail_all(EngineError("engine_down", "engine closed"))
        self._apply_deferred_frees()

    # -- memory ---------------------------------------------------------------------------------

    def _free_tensors(self, seq_id: str) -> None:
        """Free a sequence's contiguous KV tensors now or, mid-step, right after the step."""
        assert isinstance(self.store, ContiguousKVStore)
        if self._in_step:
            self._deferred_frees.append(seq_id)
        else:
            self.store.free(seq_id)

    def _apply_deferred_frees(self) -> None:
        if self._deferred_frees:
            assert isinstance(self.store, ContiguousKVStore)
            for seq_id in self._deferred_frees:
                self.store.free(seq_id)
            self._deferred_frees.clear()

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> list[tuple[_TorchSeq, int]]:
        """Plan one step with the policy the sim uses; allocates its KV slots."""
        return self.batcher.schedule()

    def _slice(self, seq: _TorchSeq, n: int) -> SeqSlice:
        start = seq.computed
        table = self.kv.block_table(seq.id) if isinstance(self.store, PagedKVPool) else []
        return SeqSlice(seq.id, seq.ids[start : start + n], start, start + n == len(seq.ids), table)

    def commit(self, plan: list[tuple[_TorchSeq, int]], sampled: list[int | None]) -> None:
        """Apply a finished step: advance each sequence, emit tokens, retire finished ones."""
        batcher = self.batcher
        seqs = batcher.seqs
        for (seq, n), token in zip(plan, sampled, strict=True):
            if seqs.get(seq.id) is not seq:
                continue
            seq.computed += n
            if token is None:
                continue
            seq.ids.append(token)
            seq.pending.append(token)
            seq.emitted += 1
            if seq.emitted == seq.max_tokens:
                batcher.finish(seq, "length")
            else:
                seq.wake()

    def _fail(self, plan: list[tuple[_TorchSeq, int]], exc: BaseException) -> None:
        """A step raised: the sequences in it get an error; the engine keeps serving the rest."""
        code = "kv_exhausted" if isinstance(exc, torch.OutOfMemoryError) else "engine_down"
        batcher = self.batcher
        for seq, _ in plan:
            if batcher.seqs.get(seq.id) is seq:
                batcher.fail(seq, EngineError(code, f"engine step failed: {exc!r}"))

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self, wakeup: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        batcher = self.batcher
        while not batcher.closed:
            plan = batcher.schedule() if batcher.seqs else []
            if not plan:
                wakeup.clear()
                await wakeup.wait()
                continue
            slices = [self._slice(seq, n) for seq, n in plan]
            started = time.perf_counter()
            self._in_step = True
            try:
                sampled = await loop.run_in_executor(self._executor, self.runner.execute, slices)
            except Exception as exc:
                self._in_step = False
                self._apply_deferred_frees()
                self._fail(plan, exc)
                continue
            self._in_step = False
            self._apply_deferred_frees()
            batcher.record_step(time.perf_counter() - started)
            self.commit(plan, sampled)
