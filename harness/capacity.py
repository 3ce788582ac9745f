"""Capacity preflight: what the engines can serve for a profile's request shape, before the run.

A profile that asks for ten times what the engines can serve measures queueing, not the serving
layer, and must say so up front. The figure comes from the sim engine's StepTimeModel (the same
model the engine sleeps by): at decode batch ``b`` every completed request costs its output
length in decode slots of ``decode_ms(b, context) / b`` plus the marginal cost of its prefill, so
``rps(b) = 1000 / (O * decode_ms(b, ctx) / b + prefill_ms(P))``; the capacity is the best ``b``
that ``max_num_seqs`` and the KV cache allow. Engines without such a model (torch, vllm) and
stacks run elsewhere get "unknown capacity" with the reason, never a sim figure.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import IO, Any

from harness.profile import Profile
from serving.engine.sim import SimConfig
from serving.engine.stepmodel import StepTimeModel, load_profile, model_shape


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
        if self.engine == "null":
            return [
                f"capacity preflight: null engine x{self.replicas}: no compute limit; "
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
    config: SimConfig | None = None,
) -> Capacity:
    """Predict capacity for ``profile`` on ``replicas`` engines of kind ``engine``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    offered = profile.rate
    if engine == "null":
        return Capacity("null", replicas, float("inf"), float("inf"), 0, 0.0, offered, 0.0, ())
    if engine != "sim":
        return Capacity.unknown(
            engine, replicas, offered, f"no step-time model for engine {engine!r}"
        )
    config = config or SimConfig()
    shape = model_shape(config.model_shape, load_profile(config.profile_path))
    model = StepTimeModel(shape)
    kv_tokens = config.kv_blocks(shape.weight_bytes, shape.kv_bytes_per_token) * config.block_size
    total_w = sum(c.weight for c in profile.classes)
    out_tokens = sum(c.weight * c.max_tokens for c in profile.classes) / total_w
    footprint = sum(c.weight * (c.prompt_tokens + c.max_tokens) for c in profile.classes) / total_w
    prefill = (
        sum(c.weight * model.prefill_ms(c.prompt_tokens, alone=False) for c in profile.classes)
        / total_w
    )
    context = sum(
        c.weight * c.max_tokens * (c.prompt_tokens + c.max_tokens / 2) for c in profile.classes
    ) / (total_w * out_tokens)
    infeasible = tuple(
        c.name
        for c in profile.classes
        if c.prompt_tokens + c.max_tokens > min(config.max_model_len, kv_tokens)
    )
    max_batch = max(1, min(config.max_num_seqs, int(kv_tokens // footprint)))
    best_rps, best_b = 0.0, 1
    b = 1
    while True:
        rps = 1000.0 / (out_tokens * model.decode_ms(b, context) / b + prefill)
        if rps > best_rps:
            best_rps, best_b = rps, b
        if b == max_batch:
            break
        b = min(max_batch, b * 2)
    unloaded = (
        sum(
            c.weight
            * (
                model.prefill_ms(c.prompt_tokens)
                + (c.max_tokens - 1) * model.decode_ms(1, c.prompt_tokens + c.max_tokens / 2)
            )
            for c in profile.classes
        )
        / total_w
    )
    rps_all = best_rps * replicas
    return Capacity(
        engine=f"sim:{config.model_shape}",
        replicas=replicas,
        requests_per_s=rps_all,
        output_tokens_per_s=rps_all * out_tokens,
        batch=best_b,
        unloaded_e2el_ms=unloaded,
        offered_requests_per_s=offered,
        multiple=offered / rps_all,
        infeasible_classes=infeasible,
    )


def kv_tokens(engine: str, engine_options: Mapping[str, Any]) -> int | None:
    """Tokens one engine replica's KV cache holds, where the engine's size is known (sim)."""
    if engine != "sim":
        return None
    config = SimConfig(**engine_options)
    shape = model_shape(config.model_shape, load_profile(config.profile_path))
    return config.kv_blocks(shape.weight_bytes, shape.kv_bytes_per_token) * config.block_size


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
        config = SimConfig(**engine_options) if engine == "sim" and engine_options else None
        cap = predict(profile, engine, replicas, config)
    out = stream if stream is not None else sys.stdout
    for line in cap.lines():
        print(line, file=out, flush=True)
        if line.startswith("WARNING") and out is not sys.stderr:
            print(line, file=sys.stderr, flush=True)
    return cap
