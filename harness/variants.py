"""Engine configurations compared on one stack (seed 003): the seed's fixed shapes against the
engine's defaults, the same workload through both.

Seed 003 set ``--max-model-len 4096``, turned prefix caching off and had its SDK truncate long
message lists client-side (marking them), and reported memory fragmentation falling from 31 % to
4 % and P95 latency 3.8x more stable. ``FIXED_SHAPES`` is that setting; a synthetic class whose
prompt and output do not fit 4096 tokens is truncated before it is sent
(``harness.promptfit.fit_classes``, keeping its output) and renamed ``<class>-truncated``, so
every request it sends is marked in its record's ``request_class``. ``ENGINE_DEFAULTS`` changes
nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Final

from harness.profile import Profile
from harness.promptfit import apply_fits, class_fits, context_length
from serving.engine.tokenrules import TokenRule

TRUNCATED: Final = "-truncated"


@dataclass(frozen=True)
class EngineVariant:
    """An engine configuration to run a stack with: options over the run's, and whether the
    client truncates prompts to the configuration's context before sending them."""

    name: str
    description: str
    engine_options: dict[str, Any] = field(default_factory=dict)
    truncate: bool = False

    def options(self, base: dict[str, Any]) -> dict[str, Any]:
        """The run's engine options with this variant's over them; a ``max_model_len`` of the
        variant's past the run's (the model's own context, fitted before) is the run's: no
        fixed shape may be longer than the model."""
        options = {**base, **self.engine_options}
        if base.get("max_model_len") and options.get("max_model_len"):
            options["max_model_len"] = min(
                int(options["max_model_len"]), int(base["max_model_len"])
            )
        return options

    def profile(self, profile: Profile, rule: TokenRule, base: dict[str, Any]) -> Profile:
        """``profile`` as this variant's client sends it (classes truncated and marked)."""
        if not self.truncate:
            return profile
        return truncated(profile, rule, context_length(self.options(base)))


FIXED_SHAPES: Final = EngineVariant(
    "fixed-shapes",
    "seed 003's fixed shapes: max_model_len 4096, prefix caching off, prompts truncated "
    "client-side to fit (marked -truncated)",
    {"max_model_len": 4096, "enable_prefix_caching": False},
    truncate=True,
)
ENGINE_DEFAULTS: Final = EngineVariant("engine-defaults", "the engine's own defaults")
VARIANTS: Final = (FIXED_SHAPES, ENGINE_DEFAULTS)


def truncated(profile: Profile, rule: TokenRule, context: int | None) -> Profile:
    """``profile`` with its classes sized under ``rule`` to fit ``context`` and each one that
    had to be cut renamed ``<class>-truncated``."""
    fits = class_fits(profile, rule, context)
    clamped = {fit.name for fit in fits if fit.clamped}
    classes = tuple(
        dataclasses.replace(c, name=c.name + TRUNCATED) if c.name in clamped else c
        for c in apply_fits(profile, fits).classes
    )
    return dataclasses.replace(profile, classes=classes)
