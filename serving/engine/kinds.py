"""Engine kinds: one table says, for each engine name, how it is configured and built, how it
counts a prompt's tokens, what capacity can be predicted for it, and what the stacks and the
harness must know of it. Every other module asks the kind (its properties), never compares an
engine's name.

GPU engines (``torch``, ``vllm``) are imported only when their kind is asked for its config or
an engine, so importing this module never imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from serving.engine.modeldir import ModelFit, no_model
from serving.engine.null import NullConfig, NullEngine
from serving.engine.sim import SimConfig, SimEngine
from serving.engine.stepmodel import ModelledEngine
from serving.engine.tokenrules import TokenRule, bytes_rule, model_tokenizer_rule
from serving.engine.types import Engine


@dataclass(frozen=True)
class EngineKind:
    """One engine kind. ``config_class`` is None for a kind that takes no options.

    Its capacity model: a reference engine has no compute limit, an engine with a step-time
    model (``modelled_engine``) has a predicted one, any other an unknown one.
    """

    name: str
    summary: str
    load_config_class: Callable[[], type | None]
    build: Callable[[Any], Engine]
    # How the engine counts a prompt's tokens under its options (the replica charges so).
    token_rule: Callable[[Mapping[str, Any]], TokenRule] = bytes_rule
    # The engine its options make, as a step-time model and limits; None without such a model.
    modelled_engine: Callable[[Mapping[str, Any]], ModelledEngine] | None = None
    # KV-cache admission applies (watermarks, prefix cache): False for an engine with no KV.
    has_kv_cache: bool = True
    # Runs real vLLM: a model path and its tokenizer, vLLM's own server and Ray Serve LLM apply.
    serves_vllm: bool = False
    # Runs a real model (weights on a device); False for an engine that only stands in for one.
    runs_model: bool = False
    # Does no work of its own: what a stack adds over it is the stack's (the overhead reference).
    is_reference: bool = False
    # Its options fitted to the model directory they name (``serving.engine.modeldir``):
    # ValueError, one line, for a model it cannot serve; the options as they are without one.
    fit_to_model: Callable[[Mapping[str, Any]], ModelFit] = no_model

    @property
    def config_class(self) -> type | None:
        return self.load_config_class()

    @property
    def has_step_model(self) -> bool:
        """Its step time is a model the harness can predict capacity from."""
        return self.modelled_engine is not None

    def make(self, config: Any) -> Engine:
        """An engine built from ``config`` (an instance of ``config_class``, or None)."""
        return self.build(config)


def _sim_modelled(options: Mapping[str, Any]) -> ModelledEngine:
    return SimConfig(**options).modelled()


def _torch_config() -> type:
    try:
        from serving.engine.torch_engine import TorchEngineConfig
    except ImportError as exc:
        raise ValueError(f"the torch engine needs PyTorch installed ({exc})") from None
    return TorchEngineConfig


def _torch_build(config: Any) -> Engine:
    from serving.engine.torch_engine import TorchEngine

    return TorchEngine(config)


def _vllm_config() -> type:
    from serving.engine.vllm_engine import VllmEngineConfig

    return VllmEngineConfig


def _vllm_fit(options: Mapping[str, Any]) -> ModelFit:
    from serving.engine.vllm_engine import fit_vllm_options

    return fit_vllm_options(options)


def _vllm_build(config: Any) -> Engine:
    from serving.engine.vllm_engine import VllmEngine

    return VllmEngine(config)


ENGINE_KINDS: dict[str, EngineKind] = {
    kind.name: kind
    for kind in (
        EngineKind(
            "sim",
            "simulated H200 engine on a calibrated step-time model (the default)",
            lambda: SimConfig,
            SimEngine,
            modelled_engine=_sim_modelled,
        ),
        EngineKind(
            "null",
            "no compute and no KV cache, a chunk per token (or per request): what a stack adds "
            "over it is the stack's",
            lambda: NullConfig,
            NullEngine,
            has_kv_cache=False,
            is_reference=True,
        ),
        EngineKind(
            "torch",
            "a small PyTorch model with a paged KV cache",
            _torch_config,
            _torch_build,
            runs_model=True,
        ),
        EngineKind(
            "vllm",
            "vLLM's engine in process (its CPU build here)",
            _vllm_config,
            _vllm_build,
            token_rule=model_tokenizer_rule,
            fit_to_model=_vllm_fit,
            serves_vllm=True,
            runs_model=True,
        ),
    )
}
ENGINES: tuple[str, ...] = tuple(ENGINE_KINDS)


def engine_kind(name: str) -> EngineKind:
    """The kind named ``name``; ValueError listing the kinds for any other name."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}") from None
