"""The SDK against real ``zl-replica`` processes over loopback: streaming, multiplexing, failover.

Every replica is its own process (as deployed) and is stopped by the fixture; faults are real
signals (SIGSTOP to freeze a replica with requests in flight, SIGKILL to crash it). No timed
assertions: every wait is bounded only so that a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from harness.certs import self_signed
from serving.engine.kvwatch import read_kv_watch
from serving.wire.tokens import count_prompt_tokens
from tests.support.sdk import Spawn, expected_text, run, session_owned_by
from tests.support.waiting import eventually
from zerolayer.client import Http1Client, ZeroLayerClient, ZeroLayerError
from zerolayer.client.timing import CLIENT_TIMEOUT, CONNECTION_LOST

# A replica of 10 KV blocks whose first request takes 9 and streams for seconds (512 tokens on
# the sim's default model), so that a second one still finds it holding them however slowly a
# loaded host lets the client send it (16-token blocks made it 80 tokens, 0.4 s).
TINY_BLOCK = 64
TINY_KV = ("--engine-option", "num_kv_blocks=10", "--engine-option", f"block_size={TINY_BLOCK}")


def test_streams_the_engines_tokens_with_a_full_timing_record(spawn: Spawn) -> None:
    replica = spawn("sim")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            async with client.stream(prompt="tell me", max_tokens=12, seed=11, session="a") as s:
                chunks = [c async for c in s]
            chat = await client.complete(prompt="tell me", max_tokens=12, seed=11, chat=True)
        t = s.timing
        assert "".join(c.text for c in chunks) == await expected_text("tell me", 12, 11)
        assert chat.text == "".join(c.text for c in chunks)
        assert sum(c.tokens for c in chunks) == 12 == t.output_tokens
        assert len(t.chunk_ns) == len(chunks) > 1
        assert t.sent_ns <= t.headers_ns <= t.first_token_ns <= t.chunk_ns[-1] <= t.end_ns
        assert t.status == 200 and t.replica == replica.url and t.retries == 0
        assert t.outcome == "completed" and t.finish_reason == "length"
        assert t.prompt_tokens == count_prompt_tokens("tell me")

    run(main())


def test_hundreds_of_concurrent_streams_share_one_connection(spawn: Spawn) -> None:
    replica = spawn("sim")
    n = 400

    async def one(client: ZeroLayerClient, i: int) -> int:
        async with client.stream(prompt=f"p{i}", max_tokens=8, session=f"s{i}") as s:
            return sum([c.tokens async for c in s])

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            tokens = await asyncio.gather(*(one(client, i) for i in range(n)))
            conns = [
                c
                for c in psutil.Process(replica.pid).net_connections("tcp")
                if c.status == psutil.CONN_ESTABLISHED
            ]
            assert tokens == [8] * n
            assert len(conns) == 1
            assert client.replicas[replica.url].conn.open_streams == 0

    run(main())


def test_large_body_is_paced_by_flow_control(spawn: Spawn) -> None:
    replica = spawn("null")
    prompt = "y" * (500 * 1024)

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            done = await client.complete(prompt=prompt, max_tokens=4)
        assert done.tokens == 4 and done.timing.prompt_tokens == count_prompt_tokens(prompt)

    run(main())


def test_http1_client_gets_the_same_stream_and_reuses_its_connection(spawn: Spawn) -> None:
    replica = spawn("sim")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as h2c:
            via_h2 = await h2c.complete(prompt="same", max_tokens=10, seed=4)
        async with Http1Client(replica.url) as h1c:
            first = await h1c.complete(prompt="same", max_tokens=10, seed=4)
            second = await h1c.complete(prompt="same", max_tokens=10, seed=4, chat=True)
            assert len(h1c._all) == 1
        assert first.text == via_h2.text == second.text
        assert first.tokens == 10 and first.timing.status == 200
        assert len(first.timing.chunk_ns) > 1 and first.timing.first_token_ns > 0

    run(main())


def test_kill_9_before_first_token_fails_over_and_marks_the_replica_down(spawn: Spawn) -> None:
    replicas = [spawn("sim") for _ in range(3)]
    urls = [r.url for r in replicas]

    async def main() -> None:
        async with ZeroLayerClient(urls, health_interval_s=0) as client:
            victim = replicas[0]
            session = session_owned_by(client, victim.url)
            order = list(client.ring.preference(session))
            await client.complete(prompt="warm", max_tokens=2, session=session)
            os.kill(victim.pid, signal.SIGSTOP)
            streams = [
                asyncio.create_task(
                    client.complete(prompt=f"q{i}", max_tokens=6, session=session, seed=i)
                )
                for i in range(20)
            ]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in streams)
            victim.kill()
            results = await asyncio.wait_for(asyncio.gather(*streams), 20)
            assert not client.is_up(victim.url)
            after = await client.complete(prompt="after", max_tokens=3, session=session)
        for i, done in enumerate(results):
            assert done.timing.tried == order[:2]
            assert done.timing.replica == order[1] and done.timing.retries == 1
            assert done.text == await expected_text(f"q{i}", 6, i)
        assert after.timing.tried == [order[1]] and after.timing.retries == 0

    run(main())


def test_no_retry_after_the_first_token(spawn: Spawn) -> None:
    replicas = [spawn("sim") for _ in range(2)]

    async def main() -> None:
        async with ZeroLayerClient([r.url for r in replicas], health_interval_s=0) as client:
            victim = replicas[0]
            session = session_owned_by(client, victim.url)
            stream = client.stream(prompt="long", max_tokens=4000, session=session)
            with pytest.raises(ZeroLayerError) as caught:
                async with stream as s:
                    got = 0
                    async for chunk in s:
                        got += chunk.tokens
                        if got >= 3 and victim.alive():
                            victim.kill()
            err = caught.value
            assert err.code == CONNECTION_LOST and not err.retryable
            assert err.timing.tried == [victim.url] and err.timing.retries == 0
            assert err.timing.first_token_ns > 0 and err.timing.outcome == "error"

    run(main())


def test_refusal_is_retried_on_the_next_replica(spawn: Spawn) -> None:
    tiny = spawn("sim", *TINY_KV)
    roomy = spawn("sim")
    prompt = "z" * 256
    max_tokens = 9 * TINY_BLOCK - count_prompt_tokens(prompt)

    async def main() -> None:
        async with ZeroLayerClient([tiny.url, roomy.url], health_interval_s=0) as client:
            session = session_owned_by(client, tiny.url)
            async with client.stream(prompt=prompt, max_tokens=max_tokens, session=session) as s:
                # The first request holds 9 of the tiny replica's 10 KV blocks while it streams
                # (seconds: see TINY_KV).
                second = await client.complete(
                    prompt=prompt, max_tokens=max_tokens, session=session
                )
                rest = [c async for c in s]
        assert s.timing.replica == tiny.url and rest
        assert second.timing.tried == [tiny.url, roomy.url]
        assert second.timing.replica == roomy.url and second.timing.retries == 1
        assert second.timing.refused_ns == 0, "the refusal was the first attempt's, not its end"
        assert second.tokens == max_tokens
        assert client.is_up(tiny.url)

    run(main())


def test_a_refusal_is_stamped_when_the_client_sees_it(spawn: Spawn, tmp_path: Path) -> None:
    """A request refused on its headers ends with the moment its error status arrived; the
    replica's KV watch saw the cache committed past the refusal point, and counts the admitted
    request, not the refused one."""
    watch = tmp_path / "kv-watch.jsonl"
    tiny = spawn("sim", *TINY_KV, "--kv-watch", str(watch))
    prompt = "z" * 256
    max_tokens = 9 * TINY_BLOCK - count_prompt_tokens(prompt)

    async def main() -> None:
        client = ZeroLayerClient([tiny.url], health_interval_s=0, max_retries=0)
        async with client, client.stream(prompt=prompt, max_tokens=max_tokens, session="s") as s:
            with pytest.raises(ZeroLayerError) as refused:
                await client.complete(prompt=prompt, max_tokens=max_tokens, session="s")
            rest = [c async for c in s]
        t = refused.value.timing
        assert rest and s.timing.refused_ns == 0
        assert refused.value.code == "kv_exhausted" and t.outcome == "error"
        assert t.sent_ns < t.refused_ns == t.headers_ns <= t.end_ns
        assert t.first_token_ns == 0 and t.attempts == 0

    run(main())
    samples = read_kv_watch(watch)
    assert samples and max(x.committed for x in samples) >= 9
    assert {x.admitted for x in samples} == {1}


def test_frozen_replica_ends_in_client_timeout_not_a_hang(spawn: Spawn) -> None:
    replica = spawn("sim")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0, grace_ms=200) as client:
            await client.complete(prompt="warm", max_tokens=2)
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                with pytest.raises(ZeroLayerError) as caught:
                    await client.complete(prompt="frozen", max_tokens=4, deadline_ms=300)
            finally:
                os.kill(replica.pid, signal.SIGCONT)
        assert caught.value.code == CLIENT_TIMEOUT
        assert caught.value.timing.outcome == "lost"
        assert caught.value.timing.end_ns > caught.value.timing.sent_ns

    run(main(), limit_s=20)


def test_health_poll_marks_a_frozen_replica_down_then_up_with_hysteresis(spawn: Spawn) -> None:
    replicas = [spawn("null") for _ in range(2)]
    frozen = replicas[0]

    async def until(pred: Callable[[], bool]) -> None:
        while not pred():
            await asyncio.sleep(0.02)

    async def main() -> None:
        # A frozen replica never answers, so down_after timeouts mark it down; one of seconds
        # keeps slow answers from the running replica (a loaded host) from marking that one down.
        async with ZeroLayerClient(
            [r.url for r in replicas],
            health_interval_s=0.1,
            health_timeout_s=3.0,
            down_after=2,
            up_after=3,
        ) as client:
            session = session_owned_by(client, frozen.url)
            await until(lambda: client.replicas[frozen.url].last_health is not None)
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(until(lambda: not client.is_up(frozen.url)), 30)
                routed = await client.complete(prompt="hi", max_tokens=2, session=session)
                assert routed.timing.tried == [replicas[1].url]
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
            await asyncio.wait_for(until(lambda: client.is_up(frozen.url)), 30)
            back = await client.complete(prompt="hi", max_tokens=2, session=session)
            assert back.timing.tried == [frozen.url]
            assert client.is_up(replicas[1].url)

    run(main())


def test_one_health_poll_that_times_out_does_not_mark_a_replica_down(spawn: Spawn) -> None:
    # A poll that times out may be a loaded host's slow answer, not a dead replica: it is one bad
    # verdict of down_after, as a bad answer is. Frozen (SIGSTOP), the replica cannot answer.
    replica = spawn("null")

    async def main() -> tuple[bool, bool]:
        async with ZeroLayerClient([replica.url], health_interval_s=0, down_after=2) as client:
            client.health_timeout_s = 30.0  # the running replica's answer, however slow
            await client.poll_health()
            assert client.replicas[replica.url].last_health is not None
            client.health_timeout_s = 0.2
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                await client.poll_health()
                after_one = client.is_up(replica.url)
                await client.poll_health()
                after_two = client.is_up(replica.url)
            finally:
                os.kill(replica.pid, signal.SIGCONT)
        return after_one, after_two

    assert run(main()) == (True, False)


def test_a_client_with_every_replica_down_still_tries_them(spawn: Spawn) -> None:
    # The replica ends the idle connection (GOAWAY), which marks it down; no health poll runs to
    # mark it up again, so unless a client whose replicas are all down tries them anyway, every
    # later request would end no_replica while the replica serves. (A second long enough that
    # the new connection carries its request before it could count as idle.)
    replica = spawn("sim", "--limit", "idle_timeout_s=1")

    async def main() -> None:
        async with ZeroLayerClient([replica.url], health_interval_s=0) as client:
            await client.complete(prompt="warm", max_tokens=2)
            await eventually(lambda: not client.is_up(replica.url), "the idle GOAWAY marked it")
            again = await client.complete(prompt="again", max_tokens=2)
        assert again.timing.tried == [replica.url] and again.timing.outcome == "completed"

    run(main())


def test_https_url_negotiates_h2_with_alpn(spawn: Spawn, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    replica = spawn("null", "--tls-cert", str(cert), "--tls-key", str(key))
    url = replica.url.replace("http://", "https://")
    tls = ssl.create_default_context(cafile=str(cert))
    tls.set_alpn_protocols(["h2"])

    async def main() -> None:
        async with ZeroLayerClient([url], tls=tls, health_interval_s=0) as client:
            done = await client.complete(prompt="secret", max_tokens=5, seed=1)
            conn = client.replicas[url].conn
            assert conn is not None
            ssl_obj = conn._transport.get_extra_info("ssl_object")
        assert ssl_obj.selected_alpn_protocol() == "h2"
        assert done.text == await expected_text("secret", 5, 1)

    run(main())
