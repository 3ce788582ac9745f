"""The shared continuous batcher as pure bookkeeping: KV stays consistent, limits hold, every
sequence ends exactly once, whatever mix of adds, steps, aborts, failures and preemptions."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from serving.engine.batching import ContinuousBatcher, Sequence
from serving.engine.kv import KVBlockManager, blocks_for
from serving.engine.streams import detokenize
from serving.engine.types import EngineError, EngineRequest


class Recorded(Sequence):
    """A sequence that records every end its stream is woken for (there must be one)."""

    __slots__ = ("ends",)

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        super().__init__(request, arrival)
        self.ends: list[str] = []

    def wake(self) -> None:
        if self.error is not None:
            self.ends.append(self.error.code)
        elif self.finish_reason is not None:
            self.ends.append(self.finish_reason)
        super().wake()


def make_batcher(
    num_blocks: int, block_size: int, max_num_seqs: int, budget: int, max_model_len: int
) -> ContinuousBatcher[Recorded]:
    return ContinuousBatcher(
        KVBlockManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        new_seq=Recorded,
        text=detokenize,
        kick=lambda: None,
    )


def advance(batcher: ContinuousBatcher[Recorded], plan: list[tuple[Recorded, int]]) -> None:
    """What an engine's ``commit`` does: compute the planned KV, emit a token once caught up."""
    for seq, n in plan:
        if batcher.seqs.get(seq.id) is not seq:
            continue
        seq.computed += n
        if seq.computed == seq.prompt_tokens + seq.emitted:
            seq.pending.append(seq.emitted)
            seq.emitted += 1
            if seq.emitted == seq.max_tokens:
                batcher.finish(seq, "length")
            else:
                seq.wake()


class BatcherMachine(RuleBasedStateMachine):
    """Drives one batcher through random operations and checks its invariants after each."""

    requests = Bundle("requests")

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([4, 8]),
        max_num_seqs=st.sampled_from([1, 2, 3, 4, 8]),
        budget=st.sampled_from([1, 3, 8, 16, 64]),
        max_model_len=st.sampled_from([24, 64, 256]),
        close_at_end=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        budget: int,
        max_model_len: int,
        close_at_end: bool,
    ) -> None:
        self.batcher = make_batcher(num_blocks, block_size, max_num_seqs, budget, max_model_len)
        self.close_at_end = close_at_end
        self.added: dict[str, Recorded] = {}
        self.next_id = 0

    def _live(self) -> list[Recorded]:
        return list(self.batcher.seqs.values())

    @rule(
        target=requests,
        specs=st.lists(
            st.tuples(st.integers(1, 12), st.integers(1, 16), st.integers(0, 2)),
            min_size=1,
            max_size=4,
        ),
    )
    def add(self, specs: list[tuple[int, int, int]]) -> object:
        """Submit a few requests; those that can never fit are refused, the rest queued."""
        batcher = self.batcher
        ids = []
        for prompt, max_tokens, priority in specs:
            rid = f"q{self.next_id}"
            self.next_id += 1
            ids.append(rid)
            request = EngineRequest(rid, prompt, max_tokens, priority=priority)
            total = prompt + max_tokens
            fits = total <= batcher.max_model_len
            fits = fits and blocks_for(total, batcher.kv.block_size) <= batcher.kv.num_blocks
            if not fits:
                with pytest.raises(EngineError) as refused:
                    batcher.add(request)
                assert refused.value.code == "prompt_too_long"
                continue
            self.added[rid] = batcher.add(request)
            with pytest.raises(EngineError) as dup:
                batcher.add(request)
            assert dup.value.code == "bad_request"
        return multiple(*ids)

    @rule(rounds=st.integers(1, 8), aborts=st.lists(requests, max_size=2))
    def step(self, rounds: int, aborts: list[str]) -> None:
        """A few engine steps; ``aborts`` arrive while the first one 'runs' (between plan and
        commit, as they do during the sim's sleep or the torch engine's worker call)."""
        for _ in range(rounds):
            plan = self._plan()
            for rid in aborts:
                self.batcher.abort(rid)
            aborts = []
            advance(self.batcher, plan)

    def _plan(self) -> list[tuple[Recorded, int]]:
        """Schedule one step and check it against the limits and the KV it allocated."""
        batcher = self.batcher
        before = {s.id: s.needs() for s in self._live()}
        plan = batcher.schedule()
        assert sum(n for _, n in plan) <= batcher.max_num_batched_tokens
        assert len(plan) <= batcher.max_num_seqs
        planned = {s.id for s, _ in plan}
        assert len(planned) == len(plan), "a sequence planned twice"
        for seq, n in plan:
            assert seq.running and batcher.seqs[seq.id] is seq
            assert 1 <= n <= before[seq.id]
            assert batcher.kv.tokens(seq.id) == seq.computed + n, "slots not allocated"
        if any(s.id not in planned for s in batcher.running):
            total = sum(n for _, n in plan)
            assert total == batcher.max_num_batched_tokens, "a running sequence left out"
        return plan

    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        live = rid in self.batcher.seqs
        self.batcher.abort(rid)
        assert rid not in self.batcher.seqs
        if live:
            assert self.added[rid].finish_reason == "abort"

    @precondition(lambda self: self.batcher.running)
    @rule()
    def preempt(self) -> None:
        batcher = self.batcher
        expected = max(batcher.running, key=lambda s: (s.priority, s.arrival))
        count = batcher.preemptions
        victim = batcher.preempt_one()
        assert victim is expected
        assert not victim.running and victim.computed == 0
        assert batcher.kv.tokens(victim.id) == 0
        assert batcher.preemptions == count + 1

    @precondition(lambda self: self.batcher.seqs)
    @rule(data=st.data())
    def fail_one(self, data: st.DataObject) -> None:
        """A step that raised: the torch engine fails the sequences it held."""
        seq = data.draw(st.sampled_from(self._live()))
        self.batcher.fail(seq, EngineError("engine_down", "step failed"))
        assert seq.id not in self.batcher.seqs

    @invariant()
    def consistent(self) -> None:
        batcher = self.batcher
        kv = batcher.kv
        kv.check()
        running = {s.id for s in batcher.running}
        assert len(batcher.running) <= batcher.max_num_seqs
        assert len(running) == len(batcher.running)
        assert set(kv.holders()) == running, "only running sequences hold KV blocks"
        for seq in self._live():
            assert seq.running == (seq.id in running)
            assert kv.tokens(seq.id) == seq.computed
            assert seq.ends == []
        waiting = [s for s in self._live() if not s.running]
        assert batcher.waiting_prefill == sum(s.needs() for s in waiting)
        stats = batcher.stats()
        assert (stats.running, stats.waiting) == (len(running), len(waiting))
        assert stats.kv_blocks_used == kv.used_blocks
        for rid, seq in self.added.items():
            assert len(seq.ends) == (0 if rid in batcher.seqs else 1), (rid, seq.ends)

    def teardown(self) -> None:
        """Run to completion (or close the engine): every request ended exactly once, KV empty."""
        batcher = getattr(self, "batcher", None)
        if batcher is None:
            return
        if self.close_at_end:
            batcher.close()
            batcher.fail_all(EngineError("engine_down", "engine closed"))
            with pytest.raises(EngineError) as refused:
                batcher.add(EngineRequest("late", 1, 1))
            assert refused.value.code == "engine_down"
        for _ in range(20_000):
            if not batcher.seqs:
                break
            plan = self._plan()
            assert plan, "live requests but nothing scheduled: the batcher stalled"
            advance(batcher, plan)
        assert not batcher.seqs and not batcher.running and not batcher.schedule()
        assert batcher.kv.used_blocks == 0 and batcher.kv.live_tokens == 0
        batcher.kv.check()
        for seq in self.added.values():
            assert len(seq.ends) == 1
            if seq.ends == ["length"]:
                assert seq.emitted == seq.max_tokens == len(seq.pending)


TestBatcherMachine = BatcherMachine.TestCase
TestBatcherMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_a_victim_already_planned_leaves_the_plan_and_returns_its_budget() -> None:
    """A low-priority sequence planned first is preempted when a later one cannot grow: it
    leaves the plan, and its tokens go to the sequences after it in the same step."""
    batcher = make_batcher(4, 4, max_num_seqs=4, budget=64, max_model_len=64)
    low = batcher.add(EngineRequest("low", 4, 8, priority=2))
    advance(batcher, batcher.schedule())
    batcher.add(EngineRequest("high", 4, 8, priority=0))
    batcher.add(EngineRequest("other", 2, 8, priority=0))
    advance(batcher, batcher.schedule())
    assert [(s.id, batcher.kv.tokens(s.id)) for s in batcher.running] == [
        ("low", 5),
        ("high", 4),
        ("other", 2),
    ]
    assert batcher.kv.free_blocks == 0, "high's next token needs a block nobody has"
    batcher.max_num_batched_tokens = 2  # a decode step smaller than the batch
    plan = batcher.schedule()
    assert [(s.id, n) for s, n in plan] == [("high", 1), ("other", 1)]
    assert batcher.preemptions == 1
    assert not low.running and low.computed == 0 and batcher.kv.tokens("low") == 0
    assert batcher.waiting_prefill == low.needs() == 4 + 2
    batcher.kv.check()


def test_stream_submits_lazily_and_aborts_when_the_consumer_leaves() -> None:
    async def main() -> None:
        kicks: list[int] = []
        batcher = ContinuousBatcher(
            KVBlockManager(8, 4),
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=32,
            new_seq=Sequence,
            text=detokenize,
            kick=lambda: kicks.append(1),
        )
        stream = batcher.stream(EngineRequest("s", 4, 3))
        assert not batcher.seqs and not kicks, "nothing is submitted before the first read"
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert "s" in batcher.seqs and kicks == [1]
        plan = batcher.schedule()
        seq = batcher.seqs["s"]
        seq.computed += plan[0][1]
        seq.pending.append(7)
        seq.emitted += 1
        seq.wake()
        chunk = await reader
        assert (chunk.token_ids, chunk.finish_reason, chunk.completion_tokens) == ([7], None, 1)
        await stream.aclose()
        assert not batcher.seqs and batcher.kv.used_blocks == 0
        assert seq.finish_reason == "abort"

    asyncio.run(main())
