"""Step-time model of a GPU engine, calibrated on measured H200 timings.

Decode: piecewise-bilinear over (batch, context) through ``decode_step_graph_ms`` (CUDA-graph
replays, the way vLLM runs decode), extrapolated linearly past the grid, so every measured point is
reproduced. Prefill: ``a + b*L + c*L^2`` solved through the three ``prefill_graph_ms`` points (the
profile README's rule: linear in L plus an attention term in L squared). A chunk of ``l`` tokens
after ``p`` already-cached tokens costs ``b*l + c*((p+l)^2 - p^2)``, plus ``a`` when it runs alone.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_PROFILE = "h200-llama-measured.json"
MODEL_SHAPES = ("llama-3.1-8b", "llama-3.2-1b")


def load_profile(path: str | Path | None = None) -> dict[str, Any]:
    """The measured profile: the packaged H200 copy unless a path is given."""
    if path is None:
        data = resources.files("serving.engine").joinpath("data")
        return json.loads(data.joinpath(DEFAULT_PROFILE).read_text())
    return json.loads(Path(path).read_text())


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extrapolating linearly beyond both ends."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelShape:
    """The figures of one model that the sim needs: sizes and the measured timing grids."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    decode_grid: dict[int, tuple[list[float], list[float]]]
    prefill_coeffs: tuple[float, float, float]


def model_shape(name: str, profile: dict[str, Any] | None = None) -> ModelShape:
    """Build a ModelShape from the profile entry ``name``."""
    profile = profile if profile is not None else load_profile()
    try:
        entry = profile["models"][name]
    except KeyError:
        known = ", ".join(profile.get("models", {}))
        raise ValueError(f"unknown model shape {name!r}; the profile has: {known}") from None
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for key, point in entry["decode_step_graph_ms"].items():
        b, c = (int(v) for v in key.split("x"))
        by_batch.setdefault(b, []).append((c, float(point["ms"])))
    grid = {
        b: ([float(c) for c, _ in sorted(pts)], [ms for _, ms in sorted(pts)])
        for b, pts in by_batch.items()
    }
    lengths = sorted((int(k), float(v)) for k, v in entry["prefill_graph_ms"].items())
    if len(lengths) < 3:
        raise ValueError(f"{name}: prefill_graph_ms needs three lengths, has {len(lengths)}")
    xs = np.array([x for x, _ in lengths], dtype=float)
    ys = np.array([y for _, y in lengths], dtype=float)
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(xs), xs, xs**2], axis=1), ys, rcond=None)[0]
    return ModelShape(
        name=name,
        weight_bytes=int(entry["weight_bytes"]),
        kv_bytes_per_token=int(entry["kv_bytes_per_token"]),
        decode_grid=grid,
        prefill_coeffs=(float(a), float(b), float(c)),
    )


class StepTimeModel:
    """Predicts how long one engine step takes, in milliseconds."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._batches = sorted(shape.decode_grid)

    def decode_ms(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences with mean context ``context`` tokens."""
        grid = self.shape.decode_grid
        per_batch = [_interp(*grid[b], float(context)) for b in self._batches]
        return max(0.0, _interp([float(b) for b in self._batches], per_batch, float(batch)))

    def prefill_ms(self, tokens: int, past: int = 0, alone: bool = True) -> float:
        """A prefill chunk of ``tokens`` after ``past`` cached tokens; ``a`` only if alone."""
        a, b, c = self.shape.prefill_coeffs
        cost = b * tokens + c * ((past + tokens) ** 2 - past**2)
        return cost + (a if alone else 0.0)

    def step_ms(self, decode_batch: int, decode_context: float, prefill_cost_ms: float) -> float:
        """A mixed step: decode time (which pays the weight read) plus the prefill's marginal cost.

        ``prefill_cost_ms`` is the sum of ``prefill_ms(..., alone=False)`` over the step's chunks.
        """
        if decode_batch:
            return self.decode_ms(decode_batch, decode_context) + prefill_cost_ms
        return self.shape.prefill_coeffs[0] + prefill_cost_ms if prefill_cost_ms else 0.0


@dataclass(frozen=True)
class ModelledEngine:
    """An engine whose step time is a StepTimeModel, sized as its config sets it: what capacity
    prediction needs of the engine without building it."""

    label: str
    model: StepTimeModel
    kv_tokens: int
    max_model_len: int
    max_num_seqs: int
