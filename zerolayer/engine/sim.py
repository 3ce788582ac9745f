"""The simulated GPU engine: vLLM V1-style continuous batching over a paged KV cache, in real time.

Each step is planned like vLLM's scheduler (running sequences first, one token budget shared by
decode and chunked prefill, ``max_num_seqs``, preemption by recompute when blocks run out), its
duration comes from :class:`StepTimeModel`, and the step ends at its modelled time on a virtual
clock, so oversleeping one step is paid back by the next and cumulative drift stays near zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from zerolayer.engine.kv import KVBlockManager
from zerolayer.engine.stepmodel import StepTimeModel, load_profile, model_shape
from zerolayer.engine.tokens import detokenize, token_array
from zerolayer.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk

H200_MEMORY_BYTES = 150_754_820_096
MAX_CATCH_UP_S = 0.02


@dataclass
class SimConfig:
    """Engine settings, named as vLLM names them; recorded in every run's metadata."""

    model_shape: str = "llama-3.1-8b"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: int = 131_072
    gpu_memory_bytes: int = H200_MEMORY_BYTES
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    profile_path: str | None = None

    def kv_blocks(self, weight_bytes: int, kv_bytes_per_token: int) -> int:
        """Blocks that fit in the memory budget after the weights (or the explicit override)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.gpu_memory_bytes * self.gpu_memory_utilization - weight_bytes
        blocks = int(budget // (kv_bytes_per_token * self.block_size))
        if blocks < 1:
            raise ValueError(f"{self.model_shape} weights do not fit in {self.gpu_memory_bytes} B")
        return blocks

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Seq:
    """One request inside the engine."""

    __slots__ = (
        "arrival",
        "computed",
        "emitted",
        "error",
        "finish_reason",
        "id",
        "ids",
        "pending",
        "priority",
        "prompt_tokens",
        "running",
        "waiter",
    )

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        self.id = request.request_id
        self.prompt_tokens = request.prompt_tokens
        self.priority = request.priority
        self.arrival = arrival
        self.ids = token_array(request.seed, request.max_tokens)
        self.computed = 0
        self.emitted = 0
        self.pending: list[int] = []
        self.finish_reason: str | None = None
        self.running = False
        self.error: EngineError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def needs(self) -> int:
        """Tokens whose KV must still be computed before the next token can be sampled."""
        return self.prompt_tokens + self.emitted - self.computed

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True)
class StepTiming:
    """One step as modelled and as it really ran (seconds), for the fidelity checks."""

    modelled_s: float
    actual_s: float
    decode_batch: int
    prefill_tokens: int


class SimEngine:
    """A real-time simulated GPU engine; see the module docstring."""

    name = "sim"

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        shape = model_shape(self.config.model_shape, load_profile(self.config.profile_path))
        self.model = StepTimeModel(shape)
        self.kv = KVBlockManager(
            self.config.kv_blocks(shape.weight_bytes, shape.kv_bytes_per_token),
            self.config.block_size,
        )
        self._running: list[_Seq] = []
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._seqs: dict[str, _Seq] = {}
        self._arrivals = itertools.count()
        self._waiting_prefill = 0
        self._preemptions = 0
        self._steps = 0
        self._busy_s = 0.0
        self._actual_busy_s = 0.0
        self._timing_resets = 0
        self._step_ms_recent = 0.0
        self.timings: deque[StepTiming] = deque(maxlen=100_000)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- public API -------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request)
        try:
            while True:
                if seq.error is not None:
                    raise seq.error
                if seq.pending or seq.finish_reason is not None:
                    ids, seq.pending = seq.pending, []
                    reason = seq.finish_reason
                    yield TokenChunk(
                        token_ids=ids,
                        text=detokenize(ids),
                        finish_reason=reason,
                        prompt_tokens=seq.prompt_tokens,
                        completion_tokens=seq.emitted,
                    )
                    if reason is not None:
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
        self.kv.free(seq.id)
        if seq.running:
            seq.running = False
            self._running.remove(seq)
        else:
            self._waiting_prefill -= seq.needs()
        seq.finish_reason = "abort"
        seq.wake()

    def stats(self) -> EngineStats:
        return EngineStats(
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
        )

    def drift(self) -> float:
        """Cumulative timing error: (actual busy time - modelled busy time) / modelled."""
        return (self._actual_busy_s - self._busy_s) / self._busy_s if self._busy_s else 0.0

    @property
    def timing_resets(self) -> int:
        """Steps where the host lagged more than MAX_CATCH_UP_S and the clock was re-anchored."""
        return self._timing_resets

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in list(self._seqs.values()):
            seq.error = EngineError("engine_down", "engine closed")
            self.kv.free(seq.id)
            seq.wake()
        self._seqs.clear()
        self._running.clear()
        self._waiting.clear()

    # -- submission ---------------------------------------------------------------------------

    def _submit(self, request: EngineRequest) -> _Seq:
        seq = self.add_request(request)
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        assert self._wakeup is not None
        self._wakeup.set()
        return seq

    def add_request(self, request: EngineRequest) -> _Seq:
        """Validate and queue a request (bookkeeping only; ``generate`` also runs the loop)."""
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
        seq = _Seq(request, next(self._arrivals))
        self._seqs[seq.id] = seq
        self._enqueue(seq)
        return seq

    def _enqueue(self, seq: _Seq) -> None:
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._waiting_prefill += seq.needs()

    # -- scheduling (pure bookkeeping, no time) ------------------------------------------------

    def _preempt_one(self) -> _Seq:
        """Preempt by recompute: the lowest-priority, newest running sequence goes back to wait."""
        victim = max(self._running, key=lambda s: (s.priority, s.arrival))
        victim.running = False
        self._running.remove(victim)
        self.kv.free(victim.id)
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

    def step_seconds(self, plan: list[tuple[_Seq, int]]) -> tuple[float, int, int]:
        """Modelled duration of a planned step, with its decode batch and prefill token count."""
        decode = 0
        context = 0
        prefill_tokens = 0
        prefill_ms = 0.0
        model = self.model
        for seq, n in plan:
            if n == 1 and seq.computed >= seq.prompt_tokens:
                decode += 1
                context += seq.computed
            else:
                prefill_tokens += n
                prefill_ms += model.prefill_ms(n, seq.computed, alone=False)
        mean_context = context / decode if decode else 0.0
        return model.step_ms(decode, mean_context, prefill_ms) / 1000.0, decode, prefill_tokens

    def commit(self, plan: list[tuple[_Seq, int]]) -> None:
        """Apply a finished step: advance each sequence, emit tokens, retire finished ones."""
        seqs = self._seqs
        for seq, n in plan:
            if seqs.get(seq.id) is not seq:
                continue
            seq.computed += n
            if seq.computed == seq.prompt_tokens + seq.emitted:
                if seq.emitted < len(seq.ids):
                    seq.pending.append(seq.ids[seq.emitted])
                    seq.emitted += 1
                if seq.emitted == len(seq.ids):
                    seq.finish_reason = "length"
                    del seqs[seq.id]
                    self.kv.free(seq.id)
                    seq.running = False
                    self._running.remove(seq)
                seq.wake()

    # -- the real-time loop -----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time
        wakeup = self._wakeup
        assert wakeup is not None
        virtual_end: float | None = None
        last_end = clock()
        while not self._closed:
            if not self._seqs:
                virtual_end = None
                wakeup.clear()
                await wakeup.wait()
                continue
            plan = self.schedule()
            if not plan:
                virtual_end = None
                wakeup.clear()
                await wakeup.wait()
                continue
            seconds, decode, prefill = self.step_seconds(plan)
            now = clock()
            if virtual_end is None or now - virtual_end > MAX_CATCH_UP_S:
                if virtual_end is not None:
                    self._timing_resets += 1
                virtual_end = now
                last_end = now
            end = virtual_end + seconds
            delay = end - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            actual_end = clock()
            self.timings.append(StepTiming(seconds, actual_end - last_end, decode, prefill))
            self._busy_s += seconds
            self._actual_busy_s += actual_end - last_end
            self._steps += 1
            self._step_ms_recent = 0.9 * self._step_ms_recent + 100.0 * seconds
            virtual_end = end
            last_end = actual_end
            self.commit(plan)
