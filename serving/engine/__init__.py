"""Engines shared by both stacks: ``sim`` (default), ``null``, and the GPU engines.

``make_engine`` is the one factory the replica server, the baseline and the bench call, so both
stacks are built from the same configuration.
"""

from __future__ import annotations

from typing import Any

from serving.engine.kinds import ENGINE_KINDS, ENGINES, EngineKind, engine_kind
from serving.engine.null import NullConfig, NullEngine
from serving.engine.options import validate_engine_options
from serving.engine.sim import SimConfig, SimEngine
from serving.engine.types import (
    Engine,
    EngineError,
    EngineRequest,
    EngineStats,
    TokenChunk,
)

__all__ = [
    "ENGINES",
    "ENGINE_KINDS",
    "Engine",
    "EngineError",
    "EngineKind",
    "EngineRequest",
    "EngineStats",
    "NullConfig",
    "NullEngine",
    "SimConfig",
    "SimEngine",
    "TokenChunk",
    "engine_kind",
    "make_engine",
]


def make_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name; options go to its config (for ``sim``: SimConfig's fields).

    Raises ValueError for an unknown engine or a bad option.
    """
    options = validate_engine_options(name, options)
    kind = engine_kind(name)
    config = kind.config_class
    return kind.make(config(**options) if config is not None else None)
