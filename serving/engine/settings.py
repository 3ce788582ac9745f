"""The settings an engine runs with, as the engine itself reports them.

Two stacks compared over "the same engine" are only comparable if their engines really run with
the same settings; a default that differs between stacks (Ray Serve LLM once set ``max_num_seqs``
to 128 where ``vllm serve`` used 1024) reads as the layer's overhead. So each engine reports what
it settled on (after its own defaults), and the harness compares the stacks on that, not on what
was asked. ``None`` is a setting the engine does not have (the null engine has none).

Across a process boundary the settings travel as text labels (a Prometheus info gauge, a stats
file): :func:`settings_labels` and :func:`settings_from_labels` are the one codec.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Final, Protocol, runtime_checkable

# The info gauge (1, the settings in its labels) a zero-layer replica's ``/metrics`` carries them
# in, as vLLM publishes its cache config (``vllm:cache_config_info``).
SETTINGS_INFO: Final = "zl_engine_settings_info"
_TRUE: Final = frozenset({"true", "1", "yes"})
_FALSE: Final = frozenset({"false", "0", "no"})


@dataclass(frozen=True)
class EngineSettings:
    """An engine's effective settings; ``None``: the engine has no such setting (not compared)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    kv_blocks: int | None = None
    prefix_caching: bool | None = None
    chunked_prefill: bool | None = None
    dtype: str | None = None
    temperature: float | None = None

    def known(self) -> dict[str, Any]:
        """The settings the engine has, by field name, in field order."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


@runtime_checkable
class ReportsSettings(Protocol):
    """An engine that reports its effective settings (every engine here does)."""

    def settings(self) -> EngineSettings: ...


def engine_settings(engine: object) -> EngineSettings:
    """What ``engine`` reports, or nothing known for one that reports nothing (a test double)."""
    return engine.settings() if isinstance(engine, ReportsSettings) else EngineSettings()


def dtype_name(dtype: object) -> str:
    """A dtype as one spelling: ``torch.float32`` and ``float32`` are the same dtype."""
    return str(dtype).removeprefix("torch.")


def settings_labels(settings: EngineSettings) -> dict[str, str]:
    """The known settings as text labels (booleans ``true``/``false``)."""
    return {
        name: str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in settings.known().items()
    }


def _parse(kind: str, text: str) -> Any:
    if kind.startswith("bool"):
        if text.lower() not in _TRUE | _FALSE:
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in _TRUE
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    return text


def settings_from_labels(labels: dict[str, str]) -> EngineSettings:
    """Labels back to settings; labels that are not a setting (``engine``, ``model_name``) and
    empty or ``None`` values are left out. ValueError for a value of the wrong type."""
    values = {}
    for f in fields(EngineSettings):
        text = labels.get(f.name)
        if text is not None and text not in ("", "None"):
            values[f.name] = _parse(str(f.type), text)
    return EngineSettings(**values)
