"""The ``torch`` engine: a Llama-shaped decoder in plain PyTorch behind the Engine protocol.

Attributes load lazily, so ``serving.engine.torch_engine.prompt`` (which the vLLM adapter
shares) can be imported without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KV_LAYOUTS": "engine",
    "TorchEngine": "engine",
    "TorchEngineConfig": "engine",
    "SHAPES": "model",
    "LlamaShape": "model",
    "get_shape": "model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
