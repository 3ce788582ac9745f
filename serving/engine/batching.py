"""Continuous batching as vLLM V1 does it, shared by the sim and torch engines.

One scheduler for both engines, so a batch the sim models and a batch the torch engine computes
are planned by the same code: running sequences first, one token budget per step shared by decode
and chunked prefill, at most ``max_num_seqs`` running, and preemption by recompute (the
lowest-priority, newest running sequence gives its KV blocks back and waits again) when blocks
run out; over a pool with a prefix cache a request is admitted on its longest cached prefix and
prefills only the rest. :class:`ContinuousBatcher` is pure bookkeeping with no clock, so its
invariants can be property-tested; each engine adds only what is its own: how a step takes time
and what tokens a step yields (its ``commit``), plus the loop that drives it (:class:`StepLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Generic, NamedTuple, TypeVar

from serving.engine.kv import KVBlockManager, blocks_for
from serving.engine.types import EngineError, EngineRequest, EngineStats, TokenChunk
from serving.wire.openai import TokenLogprob


class Sequence:
    """One request inside an engine: how much of it has KV computed and what it has emitted.

    Engines subclass it to add their own token store (``ids``); everything the scheduler and the
    stream read is here.
    """

    __slots__ = (
        "arrival",
        "block_hashes",
        "computed",
        "emitted",
        "error",
        "finish_reason",
        "id",
        "logprobs",
        "max_tokens",
        "pending",
        "preempted",
        "priority",
        "prompt_tokens",
        "running",
        "waiter",
    )

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        self.id = request.request_id
        self.prompt_tokens = request.prompt_tokens
        self.max_tokens = request.max_tokens
        self.logprobs = request.logprobs
        self.priority = request.priority
        self.arrival = arrival
        self.computed = 0
        self.emitted = 0
        self.pending: list[int] = []
        self.finish_reason: str | None = None
        self.running = False
        self.error: EngineError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.preempted = False
        self.block_hashes: list[int] | None = None

    def needs(self) -> int:
        """Tokens whose KV must still be computed before the next token can be sampled."""
        return self.prompt_tokens + self.emitted - self.computed

    def wake(self) -> None:
        """Let the stream waiting on this sequence look again (new tokens, an end, an error)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


S = TypeVar("S", bound=Sequence)


class Waiting(NamedTuple, Generic[S]):
    """A waiting sequence's place in line: most urgent class (lowest number) first, then arrival."""

    priority: int
    arrival: int
    seq: S


Plan = list[tuple[S, int]]


class ContinuousBatcher(Generic[S]):
    """Running and waiting sequences, their KV blocks, and the step planner over them.

    ``new_seq`` builds an engine's sequence type; ``on_release`` runs after a sequence's blocks
    are freed (the torch engine frees its KV tensors there); ``kick`` runs after every submitted
    request (the engine wakes its step loop there); ``text`` turns token ids into chunk text.
    """

    def __init__(
        self,
        kv: KVBlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        new_seq: Callable[[EngineRequest, int], S],
        text: Callable[[list[int]], str],
        kick: Callable[[], None],
        on_release: Callable[[str], None] | None = None,
        logprobs: Callable[[list[int], int], list[TokenLogprob]] | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._new_seq = new_seq
        self._text = text
        self._logprobs = logprobs
        self._kick = kick
        self._on_release = on_release
        self.running: list[S] = []
        self.waiting: list[Waiting[S]] = []
        self.seqs: dict[str, S] = {}
        self._arrivals = itertools.count()
        self.waiting_prefill = 0
        self.preemptions = 0
        self.steps = 0
        self.busy_s = 0.0
        self.step_ms_recent = 0.0
        self.closed = False

    # -- requests in and out ----------------------------------------------------------------

    def add(self, request: EngineRequest) -> S:
        """Validate and queue a request; refusals are EngineErrors with the contract's codes."""
        if self.closed:
            raise EngineError("engine_down", "engine is closed")
        total = request.prompt_tokens + request.max_tokens
        if total > self.max_model_len:
            raise EngineError(
                "prompt_too_long",
                f"prompt {request.prompt_tokens} + max_tokens {request.max_tokens} tokens exceeds "
                f"max_model_len {self.max_model_len}",
            )
        if blocks_for(total, self.kv.block_size) > self.kv.num_blocks:
            raise EngineError(
                "prompt_too_long",
                f"{total} tokens need more KV blocks than the engine has ({self.kv.num_blocks})",
            )
        if request.request_id in self.seqs:
            raise EngineError("bad_request", f"duplicate request id {request.request_id!r}")
        if request.logprobs is not None and self._logprobs is None:
            raise EngineError("unsupported_parameter", "this engine does not report logprobs")
        seq = self._new_seq(request, next(self._arrivals))
        seq.block_hashes = self.kv.prompt_hashes(request.prompt, request.prompt_tokens)
        self.seqs[seq.id] = seq
        self._enqueue(seq)
        return seq

    async def stream(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Submit ``request`` on first iteration and yield its tokens, one chunk per wake-up.

        A consumer that stops early (``aclose``, cancellation) aborts the request at once.
        """
        seq = self.add(request)
        self._kick()
        text = self._text
        try:
            while True:
                if seq.error is not None:
                    raise seq.error
                if seq.pending or seq.finish_reason is not None:
                    ids, seq.pending = seq.pending, []
                    reason = seq.finish_reason
                    yield TokenChunk(
                        token_ids=ids,
                        text=text(ids),
                        finish_reason=reason,
                        prompt_tokens=seq.prompt_tokens,
                        completion_tokens=seq.emitted,
                        logprobs=self._chunk_logprobs(seq, ids),
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

    def _chunk_logprobs(self, seq: S, ids: list[int]) -> list[TokenLogprob] | None:
        if seq.logprobs is None or self._logprobs is None:
            return None
        return self._logprobs(ids, seq.logprobs)

    def abort(self, request_id: str) -> None:
        """End a live request with ``abort`` and free what it holds; unknown ids are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")

    def finish(self, seq: S, reason: str) -> None:
        """End a live sequence normally (``length``) or by abort, and wake its stream."""
        self._retire(seq)
        seq.finish_reason = reason
        seq.wake()

    def fail(self, seq: S, error: EngineError) -> None:
        """End a live sequence with an error its stream raises."""
        self._retire(seq)
        seq.error = error
        seq.wake()

    def close(self) -> None:
        """Refuse new requests from now on (the engine then stops its loop and calls fail_all)."""
        self.closed = True

    def fail_all(self, error: EngineError) -> None:
        """Fail every live sequence and empty every queue: the engine is going away."""
        for seq in self.seqs.values():
            seq.error = error
            self.release(seq.id)
            seq.running = False
            seq.wake()
        self.seqs.clear()
        self.running.clear()
        self.waiting.clear()
        self.waiting_prefill = 0

    def release(self, seq_id: str) -> None:
        """Free a sequence's KV blocks, then let the engine free whatever else it holds."""
        self.kv.free(seq_id)
        if self._on_release is not None:
            self._on_release(seq_id)

    def _retire(self, seq: S) -> None:
        del self.seqs[seq.id]
        self.release(seq.id)
        if seq.running:
            seq.running = False
            self.running.remove(seq)
        else:
            self.waiting_prefill -= seq.needs()

    def _enqueue(self, seq: S) -> None:
        heapq.heappush(self.waiting, Waiting(seq.priority, seq.arrival, seq))
        self.waiting_prefill += seq.needs()

    # -- planning (no time in here) -----------------------------------------------------------

    def preempt_one(self) -> S:
        """Preempt by recompute: the lowest-priority, newest running sequence goes back to wait."""
        victim = max(self.running, key=lambda s: (s.priority, s.arrival))
        victim.running = False
        self.running.remove(victim)
        self.release(victim.id)
        victim.computed = 0
        victim.preempted = True
        self.preemptions += 1
        self._enqueue(victim)
        return victim

    def schedule(self) -> Plan[S]:
        """Plan one step: which sequences process how many tokens; allocates their KV slots.

        Running sequences come first; when one cannot grow, victims are preempted (and dropped
        from the plan if already in it) until it fits or is itself the victim. A step that
        preempted admits nobody new, so the freed blocks go to the sequences already running.
        """
        budget = self.max_num_batched_tokens
        kv = self.kv
        plan: Plan[S] = []
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if not seq.running:
                continue
            n = min(seq.needs(), budget)
            while not kv.append(seq.id, n):
                preempted = True
                victim = self.preempt_one()
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
        waiting = self.waiting
        seqs = self.seqs
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[0].seq
            if seq.finish_reason is not None or seqs.get(seq.id) is not seq:
                heapq.heappop(waiting)
                continue
            queued = seq.needs()
            if seq.block_hashes is None:
                n = min(queued, budget)
                if not kv.append(seq.id, n):
                    break
            else:
                cached = self._admit_cached(seq, seq.block_hashes, budget)
                if cached is None:
                    break
                n = cached
            heapq.heappop(waiting)
            self.waiting_prefill -= queued
            self.running.append(seq)
            seq.running = True
            plan.append((seq, n))
            budget -= n
        return plan

    def _admit_cached(self, seq: S, hashes: list[int], budget: int) -> int | None:
        """Admit ``seq`` on its longest cached prefix; the tokens it computes this step, or None
        if blocks ran out. At least one token is left to compute: its logits give the next
        token (vLLM caps a hit at the request's tokens less one, in whole blocks)."""
        kv = self.kv
        total = seq.prompt_tokens + seq.emitted
        hit = kv.lookup(hashes, total - 1)
        cached = hit * kv.block_size
        n = min(total - cached, budget)
        if not kv.admit(seq.id, hashes, hit, n, query_tokens=total, preempted=seq.preempted):
            return None
        seq.computed = cached
        return n

    # -- accounting ---------------------------------------------------------------------------

    def record_step(self, seconds: float) -> None:
        """Count a finished step of ``seconds`` busy time (modelled for sim, measured for torch)."""
        self.busy_s += seconds
        self.steps += 1
        self.step_ms_recent = 0.9 * self.step_ms_recent + 100.0 * seconds

    def stats(self) -> EngineStats:
        """The load snapshot both engines report; the torch engine adds its allocator figures."""
        kv = self.kv
        return EngineStats(
            running=len(self.running),
            waiting=len(self.seqs) - len(self.running),
            kv_blocks_used=kv.used_blocks,
            kv_blocks_total=kv.num_blocks,
            block_size=kv.block_size,
            live_tokens=kv.live_tokens,
            preemptions=self.preemptions,
            busy_time_s=self.busy_s,
            steps=self.steps,
            step_ms_recent=self.step_ms_recent,
            waiting_prefill_tokens=self.waiting_prefill,
            max_num_seqs=self.max_num_seqs,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )


class StepLoop:
    """An engine's step task: started by the first request, woken by each later one.

    ``run`` is the engine's loop; it gets the wake-up event to wait on when it has nothing to do.
    """

    def __init__(
        self, run: Callable[[asyncio.Event], Coroutine[Any, Any, None]], name: str
    ) -> None:
        self._run = run
        self._name = name
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        """Start the loop on the running event loop if needed, and wake it."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._run(self._wakeup), name=self._name
            )
        assert self._wakeup is not None
        self._wakeup.set()

    async def stop(self) -> None:
        """Cancel the loop and wait until it has stopped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
