"""Capacity preflight: what the engines can serve for a profile's request shape, before the run.

A profile that asks for ten times what the engines can serve measures queueing, not the serving
layer, and must say so up front. The figure comes from the step-time model of an engine whose
kind has one (``EngineKind.modelled_engine``: the sim's, the same model it sleeps by): at decode
batch ``b`` every completed request costs its output length in decode slots of
``decode_ms(b, context) / b`` plus the marginal cost of its prefill, so
``rps(b) = 1000 / (O * decode_ms(b, ctx) / b + prefill_ms(P))``; the capacity is the best ``b``
that ``max_num_seqs`` and the KV cache allow. A reference engine (null) has no compute limit.
Engines without such a model (torch, vllm) and stacks run elsewhere get "unknown capacity" with
the reason, never a sim figure.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import IO, Any

from harness.profile import Profile, RequestClass
from harness.promptfit import context_length
from serving.engine.kinds import engine_kind
from serving.engine.stepmodel import ModelledEngine, StepTimeModel


@dataclass(frozen=True, slots=True)
class Capacity:
    """Predicted engine capacity for a profile, and the offered load as a multiple of it."""

    engine: str
    replicas: int
    requests_per_s: float | None
    output_tokens_per_s: float | None
    batch: int | None
    unloaded_e2el_ms: float | None
    offered_requests_per_s: float
    multiple: float | None
    infeasible_classes: tuple[str, ...]
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def overloaded(self) -> bool:
        return self.multiple is not None and self.multiple > 1.0

    @classmethod
    def unknown(cls, engine: str, replicas: int, offered: float, reason: str) -> Capacity:
        """No prediction (None figures), and why."""
        return cls(engine, replicas, None, None, None, None, offered, None, (), reason)

    def lines(self) -> list[str]:
        """Human-readable preflight lines, the last a loud warning when overloaded."""
        if self.requests_per_s is None:
            return [
                f"capacity preflight: {self.engine} x{self.replicas}: unknown capacity "
                f"({self.reason}); offered {self.offered_requests_per_s:.1f} req/s"
            ]
        if math.isinf(self.requests_per_s):
            return [
                f"capacity preflight: {self.engine} engine x{self.replicas}: no compute limit; "
                f"offered {self.offered_requests_per_s:.1f} req/s"
            ]
        out = [
            f"capacity preflight: {self.engine} x{self.replicas} predicts "
            f"{self.requests_per_s:.1f} req/s, {self.output_tokens_per_s:.0f} output tok/s "
            f"(decode batch {self.batch}); unloaded E2E latency {self.unloaded_e2el_ms:.1f} ms",
            f"offered load {self.offered_requests_per_s:.1f} req/s = {self.multiple:.2f}x "
            "predicted capacity",
        ]
        for name in self.infeasible_classes:
            out.append(
                f"WARNING: class {name!r} cannot fit the engine (max_model_len or KV); "
                "every such request will be refused"
            )
        if self.overloaded:
            out.append(
                f"WARNING: OFFERED LOAD IS {self.multiple:.1f}x WHAT THE ENGINES CAN SERVE: this "
                "run measures queueing and refusals, not the serving layer"
            )
        return out


def predict(
    profile: Profile,
    engine: str = "sim",
    replicas: int = 1,
    engine_options: Mapping[str, Any] | None = None,
) -> Capacity:
    """Predict capacity for ``profile`` on ``replicas`` engines of kind ``engine``, as the kind's
    capacity model answers: none needed for a reference engine, the step-time model's figure
    where it has one, unknown otherwise."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    kind = engine_kind(engine)
    offered = profile.rate
    if kind.is_reference:
        return Capacity(engine, replicas, math.inf, math.inf, 0, 0.0, offered, 0.0, ())
    if kind.modelled_engine is None:
        return Capacity.unknown(
            engine, replicas, offered, f"no step-time model for engine {engine!r}"
        )
    return _modelled_capacity(profile, kind.modelled_engine(engine_options or {}), replicas)


def _mean(profile: Profile, value: Callable[[RequestClass], float]) -> float:
    """``value`` averaged over the profile's classes, each weighted by its share."""
    total = sum(c.weight for c in profile.classes)
    return sum(c.weight * value(c) for c in profile.classes) / total


def _best_batch(
    model: StepTimeModel, out_tokens: float, prefill_ms: float, context: float, max_batch: int
) -> tuple[float, int]:
    """The decode batch (powers of two up to ``max_batch``, and it) that completes the most
    requests a second, and that rate."""
    best_rps, best_b = 0.0, 1
    b = 1
    while True:
        rps = 1000.0 / (out_tokens * model.decode_ms(b, context) / b + prefill_ms)
        if rps > best_rps:
            best_rps, best_b = rps, b
        if b == max_batch:
            break
        b = min(max_batch, b * 2)
    return best_rps, best_b


def _unloaded_e2el_ms(profile: Profile, model: StepTimeModel) -> float:
    """A request's end-to-end latency on an idle engine, averaged over the classes."""
    return _mean(
        profile,
        lambda c: (
            model.prefill_ms(c.prompt_tokens)
            + (c.max_tokens - 1) * model.decode_ms(1, c.prompt_tokens + c.max_tokens / 2)
        ),
    )


def _modelled_capacity(profile: Profile, engine: ModelledEngine, replicas: int) -> Capacity:
    """The step-time model's capacity for the profile's mean request (see the module)."""
    model = engine.model
    out_tokens = _mean(profile, lambda c: c.max_tokens)
    footprint = _mean(profile, lambda c: c.prompt_tokens + c.max_tokens)
    prefill = _mean(profile, lambda c: model.prefill_ms(c.prompt_tokens, alone=False))
    # the mean context a decode step sees, weighted by the output tokens decoded at it
    context = _mean(profile, lambda c: c.max_tokens * (c.prompt_tokens + c.max_tokens / 2))
    context /= out_tokens
    limit = min(engine.max_model_len, engine.kv_tokens)
    infeasible = tuple(c.name for c in profile.classes if c.prompt_tokens + c.max_tokens > limit)
    max_batch = max(1, min(engine.max_num_seqs, int(engine.kv_tokens // footprint)))
    best_rps, best_b = _best_batch(model, out_tokens, prefill, context, max_batch)
    rps_all = best_rps * replicas
    return Capacity(
        engine=engine.label,
        replicas=replicas,
        requests_per_s=rps_all,
        output_tokens_per_s=rps_all * out_tokens,
        batch=best_b,
        unloaded_e2el_ms=_unloaded_e2el_ms(profile, model),
        offered_requests_per_s=profile.rate,
        multiple=profile.rate / rps_all,
        infeasible_classes=infeasible,
    )


def kv_tokens(engine: str, engine_options: Mapping[str, Any]) -> int | None:
    """Tokens one engine replica's KV cache holds, where the engine's size is known (a modelled
    engine's)."""
    modelled = engine_kind(engine).modelled_engine
    return modelled(engine_options).kv_tokens if modelled is not None else None


def context_tokens(engine: str, engine_options: Mapping[str, Any]) -> int | None:
    """One replica's context in tokens: a modelled engine's own ``max_model_len`` (its default
    where the options leave it out), else the options' or the model directory's
    (``harness.promptfit.context_length``); None where neither says."""
    modelled = engine_kind(engine).modelled_engine
    if modelled is not None:
        return modelled(engine_options).max_model_len
    return context_length(engine_options)


def preflight(
    profile: Profile,
    engine: str = "sim",
    replicas: int = 1,
    engine_options: Mapping[str, Any] | None = None,
    external: bool = False,
    stream: IO[str] | None = None,
) -> Capacity:
    """Predict, print the lines (warnings to stderr as well), and return the prediction.

    Never raises for an engine without a model or an external stack (whose engines and their
    settings this run cannot see): the capacity is then unknown, with the reason.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if external:
        cap = Capacity.unknown(
            engine, replicas, profile.rate, "external stack: its engines are not known here"
        )
    else:
        cap = predict(profile, engine, replicas, engine_options)
    out = stream if stream is not None else sys.stdout
    for line in cap.lines():
        print(line, file=out, flush=True)
        if line.startswith("WARNING") and out is not sys.stderr:
            print(line, file=sys.stderr, flush=True)
    return cap
