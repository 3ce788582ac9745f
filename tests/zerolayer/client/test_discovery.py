"""Replica discovery: the SDK follows a watched replica file, and the ring moves only the
sessions consistent hashing moves when a replica joins or leaves.

The end-to-end test runs real ``zl-replica`` processes: a replica published to the file starts
taking its sessions' requests, one withdrawn stops getting any while its in-flight requests
finish. Every wait is bounded only so that a hang fails the test.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.sdk import Spawn, run, session_owned_by
from zerolayer.client import ZeroLayerClient
from zerolayer.client.discovery import ReplicaFile, parse_replicas, write_replicas

SESSIONS = [f"s{i}" for i in range(2000)]
urls = st.lists(
    st.integers(min_value=1024, max_value=65535).map(lambda p: f"http://127.0.0.1:{p}"),
    min_size=1,
    max_size=8,
    unique=True,
)


def owners(client: ZeroLayerClient) -> dict[str, str]:
    """Each session's first choice: the replica the SDK sends it to while all are up."""
    return {s: next(iter(client._candidates(s))).url for s in SESSIONS}


@settings(max_examples=30, deadline=None)
@given(before=urls, joining=st.integers(min_value=1024, max_value=65535))
def test_a_join_moves_sessions_only_to_the_new_replica_and_a_leave_only_its_own(
    tmp_path_factory: pytest.TempPathFactory, before: list[str], joining: int
) -> None:
    new = f"http://127.0.0.2:{joining}"
    path = write_replicas(tmp_path_factory.mktemp("d") / "replicas.json", before)
    client = ZeroLayerClient([], discovery=path, health_interval_s=0)
    start = owners(client)
    write_replicas(path, [*before, new])
    client.set_replicas(client.discovery.changed() or [])
    joined = owners(client)
    moved = [s for s in SESSIONS if start[s] != joined[s]]
    assert all(joined[s] == new for s in moved)
    assert moved == [s for s in SESSIONS if joined[s] == new]
    write_replicas(path, before)
    client.set_replicas(client.discovery.changed() or [])
    assert owners(client) == start  # the leaver's sessions go back, nobody else moves
    assert [c.added for c in client.changes] == [(new,), ()]
    assert [c.removed for c in client.changes] == [(), (new,)]


def test_the_file_is_read_when_it_changes_and_a_bad_one_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    watch = ReplicaFile(path)
    assert watch.changed() is None and "cannot be read" in watch.error
    write_replicas(path, ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:1"])
    assert watch.changed() == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert watch.changed() is None  # unchanged since
    path.write_text('{"replicas": []}')
    assert watch.changed() is None and "at least one URL" in watch.error
    path.write_text('{"replicas": ["ftp://x:1"]}')
    assert watch.changed() is None and "ftp://x:1" in watch.error
    with pytest.raises(ValueError, match="not JSON"):
        parse_replicas(b"{")
    with pytest.raises(ValueError, match="at least one URL"):
        write_replicas(path, [])


def test_a_client_needs_a_replica_from_its_urls_or_its_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        ZeroLayerClient([], discovery=tmp_path / "none.json")
    client = ZeroLayerClient(["http://127.0.0.1:9"], health_interval_s=0)
    with pytest.raises(ValueError, match="at least one"):
        client.set_replicas([])
    assert client.ring.nodes == ["http://127.0.0.1:9"]


def test_the_sdk_routes_to_a_published_replica_and_away_from_a_withdrawn_one(
    spawn: Spawn, tmp_path: Path
) -> None:
    first, second = spawn("sim"), spawn("sim")
    path = write_replicas(tmp_path / "replicas.json", [first.url])

    async def served_by(client: ZeroLayerClient, session: str) -> str:
        done = await client.complete(prompt="hi", max_tokens=2, session=session)
        return done.timing.replica

    async def until(check: object) -> None:
        while not check():  # type: ignore[operator]
            await asyncio.sleep(0.01)

    async def main() -> None:
        # No health poll: it is not judged here, and a /health answer slower than its timeout
        # (a loaded host) would mark a replica down and send its sessions elsewhere.
        async with ZeroLayerClient(
            [], discovery=path, discovery_interval_s=0.02, health_interval_s=0
        ) as client:
            assert await served_by(client, "a") == first.url
            write_replicas(path, [first.url, second.url])
            await until(lambda: second.url in client.replicas)
            session = session_owned_by(client, second.url)
            assert await served_by(client, session) == second.url
            async with client.stream(prompt="long", max_tokens=200, session=session) as stream:
                write_replicas(path, [first.url])  # withdrawn while serving a stream
                await until(lambda: second.url not in client.replicas)
                assert await served_by(client, session) == first.url
                tokens = sum([c.tokens async for c in stream])
            assert tokens == 200 and stream.timing.replica == second.url
            await until(lambda: not client._leaving)  # its connection closed once idle
            os.utime(path)  # touched, same replicas: no change recorded
            watch = client.discovery
            assert watch is not None
            await until(lambda: watch._seen == watch._signature())  # the watch read it again
            assert len(client.changes) == 2

    run(main())
