"""Engines shared by both stacks: ``sim`` (default), ``null``, and the GPU engines.

``make_engine`` is the one factory the replica server, the baseline and the bench call, so both
stacks are built from the same configuration.
"""

from __future__ import annotations

from typing import Any

from zerolayer.engine.null import NullEngine
from zerolayer.engine.options import ENGINES, validate_engine_options
from zerolayer.engine.sim import SimConfig, SimEngine
from zerolayer.engine.types import (
    Engine,
    EngineError,
    EngineRequest,
    EngineStats,
    TokenChunk,
)

__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "NullEngine",
    "SimConfig",
    "SimEngine",
    "TokenChunk",
    "make_engine",
]


def make_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name; options go to its config (for ``sim``: SimConfig's fields).

    ``torch`` and ``vllm`` are imported only when asked for, so importing zerolayer never
    imports torch or vllm. Raises ValueError for an unknown engine or a bad option.
    """
    options = validate_engine_options(name, options)
    if name == "sim":
        return SimEngine(SimConfig(**options))
    if name == "null":
        return NullEngine()
    if name == "torch":
        from zerolayer.engine.torch_engine import TorchEngine, TorchEngineConfig

        return TorchEngine(TorchEngineConfig(**options))
    if name == "vllm":
        from zerolayer.engine.vllm_engine import VllmEngine, VllmEngineConfig

        return VllmEngine(VllmEngineConfig(**options))
    raise AssertionError(f"validate_engine_options let engine {name!r} through")
