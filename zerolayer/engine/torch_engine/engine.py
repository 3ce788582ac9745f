"""The ``torch`` engine: continuous batching, as the sim does it, over a real PyTorch model.

Scheduling mirrors :mod:`zerolayer.engine.sim` (running sequences first, one token budget shared
by decode and chunked prefill, ``max_num_seqs``, preemption by recompute when KV blocks run out)
and uses the same :class:`KVBlockManager` for admission in both KV layouts, so both layouts see
identical batches. The model runs in one worker thread, so the event loop keeps serving while a
step computes. The KV store is touched by the worker only while a step runs and by the loop only
between steps; an abort during a step frees its blocks at once and its tensors right after.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from zerolayer.engine.tokens import VOCAB_SIZE, detokenize
from zerolayer.engine.torch_engine.kv_contiguous import ContiguousKVStore
from zerolayer.engine.torch_engine.kv_paged import PagedBlockManager, PagedKVPool
from zerolayer.engine.torch_engine.model import build_model, get_shape
from zerolayer.engine.torch_engine.prompt import prompt_token_ids
from zerolayer.engine.torch_engine.runner import ModelRunner
from zerolayer.engine.torch_engine.step import SeqSlice
from zerolayer.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk

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


class _Seq:
    """One request inside the engine: its known token ids and how many have KV computed."""

    __slots__ = (
        "arrival",
        "computed",
        "emitted",
        "error",
        "finish_reason",
        "id",
        "ids",
        "max_tokens",
        "pending",
        "priority",
        "prompt_tokens",
        "running",
        "waiter",
    )

    def __init__(self, request: EngineRequest, arrival: int, vocab_size: int) -> None:
        self.id = request.request_id
        self.prompt_tokens = request.prompt_tokens
        self.max_tokens = request.max_tokens
        self.priority = request.priority
        self.arrival = arrival
        self.ids = prompt_token_ids(request, vocab_size)
        self.computed = 0
        self.emitted = 0
        self.pending: list[int] = []
        self.finish_reason: str | None = None
        self.running = False
        self.error: EngineError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def needs(self) -> int:
        return len(self.ids) - self.computed

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


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
        self.kv = PagedBlockManager(num_blocks, config.block_size)
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
        self._running: list[_Seq] = []
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._seqs: dict[str, _Seq] = {}
        self._arrivals = itertools.count()
        self._waiting_prefill = 0
        self._preemptions = 0
        self._steps = 0
        self._busy_s = 0.0
        self._step_ms_recent = 0.0
        self._in_step = False
        self._deferred_frees: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

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

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request)
        try:
            while True:
                if seq.error is not None:
                    raise seq.error
                if seq.pending or seq.finish_reason is not None:
                    ids, seq.pending = seq.pending, []
                    chunk = TokenChunk(
                        token_ids=ids,
                        text=detokenize([i % VOCAB_SIZE for i in ids]),
                        finish_reason=seq.finish_reason,
                        prompt_tokens=seq.prompt_tokens,
                        completion_tokens=seq.emitted,
                    )
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
                else:
                    seq.waiter = asyncio.get_running_loop().create_future()
                    await seq.waiter
                    seq.waiter = None
        finally:
            if seq.finish_reason is None:
                self.abort(seq.id)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self._release(seq.id)
        if seq.running:
            seq.running = False
            self._running.remove(seq)
        else:
            self._waiting_prefill -= seq.needs()
        seq.finish_reason = "abort"
        seq.wake()

    @property
    def in_step(self) -> bool:
        """True while a step computes; tensors of sequences aborted meanwhile are freed after it."""
        return self._in_step

    def stats(self) -> EngineStats:
        stats = EngineStats(
            running=len(self._running),
            waiting=len(self._seqs) - len(self._running),
            kv_blocks_used=self.kv.used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            block_size=self.kv.block_size,
            live_tokens=self.kv.live_tokens,
            preemptions=self._preemptions,
            busy_time_s=self._busy_s,
            steps=self._steps,
            step_ms_recent=self._step_ms_recent,
            waiting_prefill_tokens=self._waiting_prefill,
            max_num_seqs=self.config.max_num_seqs,
            allocator=self.runner.allocator,
        )
        if isinstance(self.store, ContiguousKVStore):
            # Contiguous KV has no blocks: report token slots, so kv_waste is growth slack.
            stats.block_size = 1
            stats.kv_blocks_used = self.store.capacity_tokens
            stats.kv_blocks_total = self.kv.num_blocks * self.kv.block_size
        return stats

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._in_step = False
        for seq in list(self._seqs.values()):
            seq.error = EngineError("engine_down", "engine closed")
            self._release(seq.id)
            seq.wake()
        self._apply_deferred_frees()
        self._seqs.clear()
        self._running.clear()
        self._waiting.clear()

    # -- submission and memory ------------------------------------------------------------------

    def _submit(self, request: EngineRequest) -> _Seq:
        if self._closed:
            raise EngineError("engine_down", "engine is closed")
        total = request.prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise EngineError(
                "prompt_too_long",
                f"prompt {request.prompt_tokens} + max_tokens {request.max_tokens} tokens exceeds "
                f"max_model_len {self.config.max_model_len}",
            )
        if self.kv.blocks_for(total) > self.kv.num_blocks:
            raise EngineError(
                "prompt_too_long",
                f"{total} tokens need more KV blocks than the engine has ({self.kv.num_blocks})",
            )
        if request.request_id in self._seqs:
            raise EngineError("bad_request", f"duplicate request id {request.request_id!r}")
        seq = _Seq(request, next(self._arrivals), self.shape.vocab_size)
        self._seqs[seq.id] = seq
        self._enqueue(seq)
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="torch-engine")
        assert self._wakeup is not None
        self._wakeup.set()
        return seq

    def _release(self, seq_id: str) -> None:
        """Free a sequence's blocks now, and its tensors now or, mid-step, right after the step."""
        self.kv.free(seq_id)
        if isinstance(self.store, ContiguousKVStore):
            if self._in_step:
                self._deferred_frees.append(seq_id)
            else:
                self.store.free(seq_id)

    def _apply_deferred_frees(self) -> None:
        if isinstance(self.store, ContiguousKVStore):
            for seq_id in self._deferred_frees:
                self.store.free(seq_id)
        self._deferred_frees.clear()

    def _enqueue(self, seq: _Seq) -> None:
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._waiting_prefill += seq.needs()

    # -- scheduling (bookkeeping only; same policy as the sim) ------------------------------------

    def _preempt_one(self) -> _Seq:
        """Preempt by recompute: the lowest-priority, newest running sequence goes back to wait."""
        victim = max(self._running, key=lambda s: (s.priority, s.arrival))
        victim.running = False
        self._running.remove(victim)
        self._release(victim.id)
        victim.computed = 0
        self._preemptions += 1
        self._enqueue(victim)
        return victim

    def schedule(self) -> list[tuple[_Seq, int]]:
        """Plan one step: which sequences process how many tokens; allocates their KV slots."""
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        plan: list[tuple[_Seq, int]] = []
        preempted = False
        for seq in list(self._running):
            if budget <= 0:
                break
            if not seq.running:
                continue
            n = min(seq.needs(), budget)
            while not kv.append(seq.id, n):
                preempted = True
                victim = self._preempt_one()
                if victim is seq:
                    n = 0
                    break
                for i, (planned, tokens) in enumerate(plan):
                    if planned is victim:
                        del plan[i]
                        budget += tokens
                        break
            if n:
                plan.append((seq, n))
                budget -= n
        if preempted:
            return plan
        waiting = self._waiting
        while waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = waiting[0][2]
            if seq.finish_reason is not None or self._seqs.get(seq.id) is not seq:
                heapq.heappop(waiting)
                continue
            n = min(seq.needs(), budget)
            if not kv.append(seq.id, n):
                break
            heapq.heappop(waiting)
            self._waiting_prefill -= seq.needs()
            self._running.append(seq)
            seq.running = True
            plan.append((seq, n))
            budget -= n
        return plan

    def _slice(self, seq: _Seq, n: int) -> SeqSlice:
        start = seq.computed
        table = self.kv.block_table(seq.id) if isinstance(self.store, PagedKVPool) else []
        return SeqSlice(seq.id, seq.ids[start : start + n], start, start + n == len(seq.ids), table)

    def commit(self, plan: list[tuple[_Seq, int]], sampled: list[int | None]) -> None:
        """Apply a finished step: advance each sequence, emit tokens, retire finished ones."""
        seqs = self._seqs
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
                seq.finish_reason = "length"
                del seqs[seq.id]
                self._release(seq.id)
                seq.running = False
                self._running.remove(seq)
            seq.wake()

    def _fail(self, plan: list[tuple[_Seq, int]], exc: BaseException) -> None:
        """A step raised: the sequences in it get an error; the engine keeps serving the rest."""
        code = "kv_exhausted" if isinstance(exc, torch.OutOfMemoryError) else "engine_down"
        for seq, _ in plan:
            if self._seqs.get(seq.id) is not seq:
                continue
            del self._seqs[seq.id]
            self._release(seq.id)
            if seq.running:
                seq.running = False
                self._running.remove(seq)
            seq.error = EngineError(code, f"engine step failed: {exc!r}")
            seq.wake()

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wakeup = self._wakeup
        assert wakeup is not None
        while not self._closed:
            plan = self.schedule() if self._seqs else []
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
            elapsed = time.perf_counter() - started
            self._busy_s += elapsed
            self._steps += 1
            self._step_ms_recent = 0.9 * self._step_ms_recent + 100.0 * elapsed
            self.commit(plan, sampled)
