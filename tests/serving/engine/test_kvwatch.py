"""The KV watch: an engine's committed KV stamped under pressure, nothing written below it."""

from __future__ import annotations

import asyncio
from itertools import pairwise
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from serving.engine import EngineRequest, SimConfig, SimEngine
from serving.engine.kvwatch import KvSample, KvWatch, read_kv_watch, sample_of


def sample(used: int, waiting_tokens: int = 0, pending: int = 0, admitted: int = 0) -> KvSample:
    return KvSample(0, used, waiting_tokens, 100, 16, pending, admitted)


def test_committed_counts_blocks_in_use_the_waiting_prefill_and_the_promised() -> None:
    s = sample(10, waiting_tokens=33, pending=5)
    assert s.committed == 10 + 3 + 5 and s.committed_fraction == 0.18


def test_only_samples_at_or_above_the_level_that_changed_are_kept_and_the_fall_below() -> None:
    watch = KvWatch(lambda: None, "unused", record_from=0.5)  # type: ignore[arg-type,return-value]
    kept = [watch.keep(s) for s in (sample(10), sample(60), sample(60), sample(70, admitted=1),
                                    sample(30), sample(20), sample(55))]  # fmt: skip
    assert kept == [False, True, False, True, True, False, True]


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 3)), max_size=40))
def test_no_two_kept_samples_in_a_row_are_the_same_reading(readings: list[tuple[int, int]]) -> None:
    watch = KvWatch(lambda: None, "unused")  # type: ignore[arg-type,return-value]
    kept = [s for s in (sample(u, admitted=a) for u, a in readings) if watch.keep(s)]
    assert all((a.used, a.admitted) != (b.used, b.admitted) for a, b in pairwise(kept))
    assert all(s.committed_fraction >= 0.5 or k > 0 for k, s in enumerate(kept))


def test_a_sim_engine_filling_up_is_stamped_in_time_order(tmp_path: Path) -> None:
    """Requests queued in a real sim engine (64 blocks of 16 tokens) raise its waiting prefill:
    the watch writes each step up past half the cache, with the host's admitted count."""
    engine = SimEngine(SimConfig(num_kv_blocks=64))
    taken = [0]
    path = tmp_path / "kv-watch-x.jsonl"

    async def main() -> None:
        watch = KvWatch(engine.stats, path, admitted=lambda: taken[0], interval_s=0.001)
        watch.start()
        for i in range(6):
            engine.add_request(EngineRequest(f"r{i}", prompt_tokens=160, max_tokens=8))
            taken[0] += 1
            await asyncio.sleep(0.02)
        await watch.stop()
        await engine.close()

    asyncio.run(main())
    samples = read_kv_watch(path)
    assert samples and samples[-1].admitted == 6 and samples[-1].committed == 60
    assert all(s.committed == 10 * s.admitted >= 32 for s in samples), "written from half full"
    assert [s.t_ns for s in samples] == sorted(s.t_ns for s in samples)
    assert len({s.admitted for s in samples}) == len(samples), "each a new reading"
    assert sample_of(engine.stats(), 0, 0, 1).total == 64
