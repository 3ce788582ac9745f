"""The engine-replica deployment: the same engine the zero-layer replica runs, behind Serve.

Chunks and engine errors cross the actor boundary as the named tuples of ``items``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from ray import serve

from baselines.rayserve.items import ChunkItem, EngineItem, ErrorItem
from serving.engine import EngineError, EngineRequest, EngineStats, make_engine
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


class EngineReplica:
    """Wraps ``make_engine(name, **options)``; one engine per replica process."""

    def __init__(
        self, engine: str, engine_options: dict[str, Any], stats_dir: str | None = None
    ) -> None:
        self.engine = make_engine(engine, **engine_options)
        self.closed = False
        self.stats_path = (
            Path(stats_dir) / f"{STATS_PREFIX}{os.getpid()}.jsonl" if stats_dir else None
        )

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[EngineItem]:
        """Stream one request's chunks; cancellation (client gone) aborts it in the engine."""
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
        await self.engine.close()


def engine_deployment() -> serve.Deployment:
    """The undecorated class as a Serve deployment (options are applied by the stand-up)."""
    return serve.deployment(name="EngineReplica")(EngineReplica)
