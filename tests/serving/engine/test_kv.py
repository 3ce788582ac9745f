"""Property tests: KV blocks never leak or double-free over any sequence of operations."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.engine.kv import KVBlockManager, PrefixCachingKVBlockManager, blocks_for

SEQ_IDS = st.sampled_from([f"s{i}" for i in range(6)])


class KVMachine(RuleBasedStateMachine):
    """Drives the manager with allocate / append / free / preempt and checks it against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVBlockManager(num_blocks=24, block_size=4)
        self.model: dict[str, int] = {}

    @rule(seq=SEQ_IDS, tokens=st.integers(0, 40))
    def append(self, seq: str, tokens: int) -> None:
        free_before = self.kv.free_blocks
        need = self.kv.blocks_needed(seq, tokens)
        ok = self.kv.append(seq, tokens)
        assert ok == (need <= free_before)
        if ok:
            self.model[seq] = self.model.get(seq, 0) + tokens
            assert self.kv.free_blocks == free_before - need
        else:
            assert self.kv.free_blocks == free_before

    @rule(seq=SEQ_IDS)
    def free(self, seq: str) -> None:
        held = blocks_for(self.model.get(seq, 0), self.kv.block_size) if seq in self.model else 0
        assert self.kv.free(seq) == held
        self.model.pop(seq, None)
        assert self.kv.free(seq) == 0

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def preempt_newest(self, data: st.DataObject) -> None:
        """Preemption by recompute frees the victim's blocks, then it re-allocates its prefix."""
        victim = data.draw(st.sampled_from(sorted(self.model)))
        tokens = self.model.pop(victim)
        self.kv.free(victim)
        if self.kv.append(victim, tokens):
            self.model[victim] = tokens

    @invariant()
    def no_leak(self) -> None:
        self.kv.check()
        held = sum(blocks_for(t, self.kv.block_size) for t in self.model.values())
        assert self.kv.used_blocks == held
        assert self.kv.live_tokens == sum(self.model.values())


TestKVNeverLeaks = KVMachine.TestCase
TestKVNeverLeaks.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class CachingKVMachine(KVMachine):
    """The prefix-caching pool keeps the same books for sequences it has no names for."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = PrefixCachingKVBlockManager(num_blocks=24, block_size=4)


TestCachingKVNeverLeaks = CachingKVMachine.TestCase
TestCachingKVNeverLeaks.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_refused_append_changes_nothing() -> None:
    kv = KVBlockManager(num_blocks=2, block_size=16)
    assert kv.append("a", 20)
    assert not kv.append("b", 17)
    assert kv.free_blocks == 0 and kv.holders() == ["a"]
    kv.check()


def test_check_detects_a_leak() -> None:
    kv = KVBlockManager(num_blocks=4, block_size=16)
    kv.append("a", 16)
    kv._free.pop()
    try:
        kv.check()
    except AssertionError:
        return
    raise AssertionError("check() missed a leaked block")
