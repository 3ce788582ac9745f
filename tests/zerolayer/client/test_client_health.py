"""Health hysteresis, the /health verdict and the replicas a request may try, without sockets."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerolayer.client import ZeroLayerClient
from zerolayer.client.health import Hysteresis, healthy
from zerolayer.client.replica import ReplicaEndpoint


def test_starts_up_and_needs_k_bad_in_a_row_to_go_down() -> None:
    h = Hysteresis(down_after=3, up_after=2)
    assert h.up
    assert not h.observe(False)
    assert not h.observe(False)
    assert h.up
    assert h.observe(False)
    assert not h.up


def test_a_good_verdict_resets_the_bad_run() -> None:
    h = Hysteresis(down_after=2, up_after=2)
    for verdict in (False, True, False, True, False):
        h.observe(verdict)
        assert h.up


def test_needs_m_good_in_a_row_to_come_back() -> None:
    h = Hysteresis(down_after=1, up_after=3)
    h.observe(False)
    assert not h.up
    h.observe(True)
    h.observe(True)
    h.observe(False)
    h.observe(True)
    h.observe(True)
    assert not h.up
    assert h.observe(True)
    assert h.up


def test_force_down_is_immediate_and_recovery_still_needs_m_good() -> None:
    h = Hysteresis(down_after=5, up_after=2)
    assert h.force_down()
    assert not h.up
    assert not h.force_down()
    h.observe(True)
    assert not h.up
    h.observe(True)
    assert h.up


def test_rejects_zero_thresholds() -> None:
    with pytest.raises(ValueError):
        Hysteresis(down_after=0)


@pytest.mark.parametrize(
    ("status", "payload", "ok"),
    [
        (200, {"score": 0.9, "draining": False}, True),
        (200, {"score": 0.0}, False),
        (200, {"score": 1.0, "draining": True}, False),
        (503, {"score": 1.0}, False),
        (200, None, False),
        (200, {"score": "high"}, False),
    ],
)
def test_health_verdict(status: int, payload: dict | None, ok: bool) -> None:
    assert healthy(status, payload) is ok


@given(st.lists(st.booleans(), min_size=1, max_size=8), st.text(max_size=12))
def test_a_request_tries_the_up_replicas_in_ring_order_or_all_when_none_is_up(
    ups: list[bool], session: str
) -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(len(ups))]
    client = ZeroLayerClient(urls, health_interval_s=0)
    for url, up in zip(urls, ups, strict=True):
        if not up:
            client.replicas[url].force_down()
    ring_order = list(client.ring.preference(session))
    up_in_order = [url for url in ring_order if client.is_up(url)]
    tried = [replica.url for replica in client._candidates(session)]
    assert tried == (up_in_order or ring_order)


@given(st.lists(st.booleans(), max_size=12))
def test_an_endpoint_stamps_each_change_of_its_verdict_as_it_changes(verdicts: list[bool]) -> None:
    """The time the SDK's verdict changed, not the time a reader looked: the chaos load's health
    log judges each routed request against it."""
    replica = ReplicaEndpoint("http://127.0.0.1:9000", down_after=2, up_after=2)
    stamps = [replica.changed_ns]
    for ok in verdicts:
        before, was_up = time.time_ns(), replica.health.up
        replica.observe(ok)
        if replica.health.up != was_up:
            assert before <= replica.changed_ns <= time.time_ns()
        else:
            assert replica.changed_ns == stamps[-1], "no change, no new stamp"
        stamps.append(replica.changed_ns)
    before, was_up = time.time_ns(), replica.health.up
    replica.force_down()
    assert (replica.changed_ns >= before) is was_up
