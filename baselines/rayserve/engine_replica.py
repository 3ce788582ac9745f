"""The engine-replica deployment: the same engine the zero-layer replica runs, behind Serve.

Chunks and engine errors cross the actor boundary as the named tuples of ``items``, gathered into
lists by Ray Serve LLM's own ``Batcher`` every ``stream_batching_interval_ms`` (as its LLMServer
streams to its ingress), so that an engine step of many streams is not one Ray item per stream
per step; an interval of 0 sends every item in a list of its own. With a stats directory, a
replica also stamps its engine's KV under pressure there (``kv-watch-<pid>.jsonl``,
``serving.engine.kvwatch``), counting as taken every request Serve hands it, and keeps a request
log (``engine-requests-<pid>.jsonl``): one line when its engine is loaded (``ready``) and one
per request it receives (its session and when), the access log an engine server writes;
profile G reads from it when a new replica took its first request and which replica served
each session.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from ray import serve
from ray.llm._internal.serve.utils.batcher import Batcher

from baselines.rayserve.config import REQUESTS_PREFIX
from baselines.rayserve.items import ChunkItem, EngineItem, ErrorItem
from serving.engine import EngineError, EngineRequest, EngineStats, make_engine
from serving.engine.kvwatch import FILE_PREFIX as KV_WATCH_PREFIX
from serving.engine.kvwatch import KvWatch
from serving.engine.settings import EngineSettings, engine_settings

STATS_PREFIX = "engine-stats-"


def publish_stats(path: Path, stats: EngineStats, settings: EngineSettings | None = None) -> None:
    """Append one stats snapshot: the replica lives in a Ray worker the bench cannot call into
    per replica, so it publishes its own figures at every health check (about once a second),
    with the settings its engine runs with (``settings``, read back by the parity check)."""
    snapshot = {"t_ns": time.time_ns(), **asdict(stats)}
    if settings is not None:
        snapshot["settings"] = settings.known()
    with open(path, "ab") as fh:
        fh.write(orjson.dumps(snapshot) + b"\n")


class RequestLog:
    """One line per event, appended with a single ``write`` on an ``O_APPEND`` descriptor: no
    buffer to lose when Serve stops the replica, and a line is whole whoever reads it."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def open(cls, stats_dir: str | None) -> RequestLog | None:
        """This replica's log in ``stats_dir`` (none without one), its first line ``ready``:
        the engine is loaded."""
        if not stats_dir:
            return None
        log = cls(Path(stats_dir) / f"{REQUESTS_PREFIX}{os.getpid()}.jsonl")
        log.write("ready", pid=os.getpid())
        return log

    def write(self, event: str, **fields: Any) -> None:
        os.write(self.fd, orjson.dumps({"event": event, "t_ns": time.time_ns(), **fields}) + b"\n")

    def close(self) -> None:
        os.close(self.fd)


class EngineReplica:
    """Wraps ``make_engine(name, **options)``; one engine per replica process."""

    def __init__(
        self,
        engine: str,
        engine_options: dict[str, Any],
        stats_dir: str | None = None,
        batching_ms: float = 0.0,
    ) -> None:
        self.engine = make_engine(engine, **engine_options)
        self.batching_ms = batching_ms
        self.closed = False
        self.stats_path = (
            Path(stats_dir) / f"{STATS_PREFIX}{os.getpid()}.jsonl" if stats_dir else None
        )
        self.log = RequestLog.open(stats_dir)
        self.admitted = 0
        self.kv_watch = None
        if stats_dir:
            path = Path(stats_dir) / f"{KV_WATCH_PREFIX}{os.getpid()}.jsonl"
            self.kv_watch = KvWatch(self.engine.stats, path, admitted=lambda: self.admitted)

    async def generate(
        self, request: dict[str, Any], session: str = ""
    ) -> AsyncIterator[list[EngineItem]]:
        """Stream one request's items in batches, one per batching interval (see the module
        docstring); cancellation (client gone) aborts it in the engine. ``session``: what the
        router picked this replica by, for the request log."""
        if self.log is not None:
            self.log.write("request", session=session, request_id=request["request_id"])
        self.admitted += 1
        if self.kv_watch is not None:
            self.kv_watch.start()  # once, on the actor's event loop, which runs here
        batcher = Batcher[EngineItem](self._items(request), interval_ms=self.batching_ms)
        async for batch in batcher.stream():
            yield list(batch)

    async def _items(self, request: dict[str, Any]) -> AsyncGenerator[EngineItem, None]:
        """One request's chunks as items, an engine error as a final ErrorItem."""
        try:
            async for chunk in self.engine.generate(EngineRequest(**request)):
                yield ChunkItem(
                    chunk.text,
                    len(chunk.token_ids),
                    chunk.finish_reason,
                    chunk.prompt_tokens,
                    chunk.completion_tokens,
                    chunk.logprobs,
                )
        except EngineError as exc:
            yield ErrorItem(exc.code, str(exc))

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; a failure replaces the replica."""
        if self.closed:
            raise RuntimeError("engine closed")
        stats = self.engine.stats()
        if self.stats_path is not None:
            publish_stats(self.stats_path, stats, engine_settings(self.engine))

    async def __del__(self) -> None:
        self.closed = True
        if self.kv_watch is not None:
            await self.kv_watch.stop()
        if self.log is not None:
            self.log.close()
        await self.engine.close()


def engine_deployment() -> serve.Deployment:
    """The undecorated class as a Serve deployment (options are applied by the stand-up)."""
    return serve.deployment(name="EngineReplica")(EngineReplica)
