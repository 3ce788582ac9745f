"""The hash ring: changing one of N replicas moves about 1/N of the keys, and no others."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerolayer.client.ring import HashRing

KEYS = [f"session-{i}" for i in range(3000)]

names = st.lists(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789:/.", min_size=1, max_size=24),
    min_size=2,
    max_size=10,
    unique=True,
)


def owners(ring: HashRing) -> dict[str, str]:
    return {key: ring.lookup(key) for key in KEYS}


@settings(max_examples=40, deadline=None)
@given(nodes=names, pick=st.integers(min_value=0))
def test_removing_a_replica_moves_only_its_keys(nodes: list[str], pick: int) -> None:
    ring = HashRing(nodes)
    before = owners(ring)
    gone = nodes[pick % len(nodes)]
    ring.remove(gone)
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)
    assert all(after[k] != gone for k in KEYS)
    assert len(moved) == sum(1 for k in KEYS if before[k] == gone)
    share = len(moved) / len(KEYS)
    assert 0.4 / len(nodes) < share < 1.8 / len(nodes)


@settings(max_examples=40, deadline=None)
@given(nodes=names, new=st.text(alphabet="ABCDEFGHIJ", min_size=1, max_size=12))
def test_adding_a_replica_moves_keys_only_to_it(nodes: list[str], new: str) -> None:
    ring = HashRing(nodes)
    before = owners(ring)
    ring.add(new)
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == new for k in moved)
    n = len(nodes) + 1
    assert 0.4 / n < len(moved) / len(KEYS) < 1.8 / n


def test_preference_lists_every_replica_once_starting_at_the_owner() -> None:
    nodes = [f"http://127.0.0.1:{8000 + i}" for i in range(5)]
    ring = HashRing(nodes, vnodes=50)
    for key in KEYS[:200]:
        order = list(ring.preference(key))
        assert order[0] == ring.lookup(key)
        assert sorted(order) == sorted(nodes)


def test_failover_order_is_the_ring_without_the_owner() -> None:
    nodes = [f"r{i}" for i in range(6)]
    ring = HashRing(nodes)
    for key in KEYS[:200]:
        first, *rest = ring.preference(key)
        ring.remove(first)
        assert ring.lookup(key) == rest[0]
        ring.add(first)


def test_spread_is_even_with_virtual_nodes() -> None:
    ring = HashRing([f"r{i}" for i in range(4)])
    counts: dict[str, int] = {}
    for owner in owners(ring).values():
        counts[owner] = counts.get(owner, 0) + 1
    assert max(counts.values()) / min(counts.values()) < 1.5


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError):
        HashRing(["a"], vnodes=0)
    ring = HashRing(["a"])
    with pytest.raises(ValueError):
        ring.add("a")
    ring.remove("a")
    with pytest.raises(LookupError):
        ring.lookup("k")
    assert list(ring.preference("k")) == []
