"""The simulated GPU engine: vLLM V1-style continuous batching over a paged KV cache, in real time.

Each step is planned by the :class:`ContinuousBatcher` the torch engine also uses (vLLM's policy:
running sequences first, one token budget shared by decode and chunked prefill, ``max_num_seqs``,
preemption by recompute when blocks run out, automatic prefix caching unless
``enable_prefix_caching`` is off), its duration comes from :class:`StepTimeModel` (which charges
prefill only for the tokens the prefix cache did not already hold), and the step ends at its
modelled time on a virtual clock, so oversleeping one step is paid back by the next and cumulative
drift stays near zero.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from serving.engine.batching import ContinuousBatcher, Sequence, StepLoop
from serving.engine.kv import KVBlockManager, PrefixCachingKVBlockManager
from serving.engine.settings import EngineSettings
from serving.engine.stepmodel import ModelledEngine, StepTimeModel, load_profile, model_shape
from serving.engine.streams import detokenize, token_array, uniform_logprobs
from serving.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk

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
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        """Refuse settings no engine could run with, before any memory is sized from them."""
        counts = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        model_shape(self.model_shape, load_profile(self.profile_path))  # names the known shapes

    def kv_blocks(self, weight_bytes: int, kv_bytes_per_token: int) -> int:
        """Blocks that fit in the memory budget after the weights (or the explicit override)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.gpu_memory_bytes * self.gpu_memory_utilization - weight_bytes
        blocks = int(budget // (kv_bytes_per_token * self.block_size))
        if blocks < 1:
            raise ValueError(f"{self.model_shape} weights do not fit in {self.gpu_memory_bytes} B")
        return blocks

    def modelled(self) -> ModelledEngine:
        """The engine these settings build, as its step-time model and limits (for capacity)."""
        shape = model_shape(self.model_shape, load_profile(self.profile_path))
        blocks = self.kv_blocks(shape.weight_bytes, shape.kv_bytes_per_token)
        return ModelledEngine(
            label=f"sim:{self.model_shape}",
            model=StepTimeModel(shape),
            kv_tokens=blocks * self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _SimSeq(Sequence):
    """A sequence whose output tokens are fixed up front by its seed (``ids``, packed)."""

    __slots__ = ("ids",)

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        super().__init__(request, arrival)
        self.ids = token_array(request.seed, request.max_tokens)


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
        pool = PrefixCachingKVBlockManager if self.config.enable_prefix_caching else KVBlockManager
        self.kv = pool(
            self.config.kv_blocks(shape.weight_bytes, shape.kv_bytes_per_token),
            self.config.block_size,
        )
        self._loop = StepLoop(self._run, "sim-engine")
        self.batcher: ContinuousBatcher[_SimSeq] = ContinuousBatcher(
            self.kv,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.config.max_model_len,
            new_seq=_SimSeq,
            text=detokenize,
            logprobs=uniform_logprobs,
            kick=self._loop.kick,
        )
        self._actual_busy_s = 0.0
        self._timing_resets = 0
        self.timings: deque[StepTiming] = deque(maxlen=100_000)

    # -- public API -------------------------------------------------------------------------

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        return self.batcher.stream(request)

    def abort(self, request_id: str) -> None:
        self.batcher.abort(request_id)

    def stats(self) -> EngineStats:
        return self.batcher.stats()

    def settings(self) -> EngineSettings:
        """What this engine runs with: its config, the KV blocks it sized, and chunked prefill
        (the batcher always chunks, as vLLM V1 does); no dtype or sampling of its own."""
        config = self.config
        return EngineSettings(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            block_size=self.kv.block_size,
            kv_blocks=self.kv.num_blocks,
            prefix_caching=isinstance(self.kv, PrefixCachingKVBlockManager),
            chunked_prefill=True,
        )

    def drift(self) -> float:
        """Cumulative timing error: (actual busy time - modelled busy time) / modelled."""
        busy = self.batcher.busy_s
        return (self._actual_busy_s - busy) / busy if busy else 0.0

    @property
    def timing_resets(self) -> int:
        """Steps where the host lagged more than MAX_CATCH_UP_S and the clock was re-anchored."""
        return self._timing_resets

    async def close(self) -> None:
        self.batcher.close()
        await self._loop.stop()
        self.batcher.fail_all(EngineError("engine_down", "engine closed"))

    # -- stepping without time (the benchmark and fidelity checks drive these directly) ---------

    def add_request(self, request: EngineRequest) -> _SimSeq:
        """Validate and queue a request (bookkeeping only; ``generate`` also runs the loop)."""
        return self.batcher.add(request)

    def schedule(self) -> list[tuple[_SimSeq, int]]:
        """Plan one step (see :meth:`ContinuousBatcher.schedule`); allocates its KV slots."""
        return self.batcher.schedule()

    def step_seconds(self, plan: list[tuple[_SimSeq, int]]) -> tuple[float, int, int]:
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

    def commit(self, plan: list[tuple[_SimSeq, int]]) -> None:
        """Apply a finished step: advance each sequence, emit its next token, retire the done."""
        batcher = self.batcher
        seqs = batcher.seqs
        for seq, n in plan:
            if seqs.get(seq.id) is not seq:
                continue
            seq.computed += n
            if seq.computed == seq.prompt_tokens + seq.emitted:
                seq.pending.append(seq.ids[seq.emitted])
                seq.emitted += 1
                if seq.emitted == seq.max_tokens:
                    batcher.finish(seq, "length")
                else:
                    seq.wake()

    # -- the real-time loop -----------------------------------------------------------------

    async def _run(self, wakeup: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time
        batcher = self.batcher
        virtual_end: float | None = None
        last_end = clock()
        while not batcher.closed:
            plan = batcher.schedule() if batcher.seqs else None
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
            batcher.record_step(seconds)
            self._actual_busy_s += actual_end - last_end
            virtual_end = end
            last_end = actual_end
            self.commit(plan)
