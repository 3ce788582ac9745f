"""Step times of the real vLLM, measured through its own engine, as a profile the sim loads.

``zl-bench calibrate --engine vllm --engine-option model=DIR --out P`` starts ``vllm.LLM`` (the
offline engine: vLLM's scheduler and CPU worker in an engine-core process, as the replica's
``AsyncLLM`` runs them) with the adapter's engine settings, and times whole ``generate`` calls:

- decode at batch B and context C: B requests of ``C - k/2`` prompt tokens generating ``k + 1``
  tokens, minus B fresh ones generating 1, over ``k``. The prefill, request setup and output
  handling are in both and cancel, leaving k decode steps whose mean context is C.
- prefill at length L: one request of L prompt tokens generating one token, so the figure is a
  whole first-token step, call overhead included, as a replica's TTFT pays it.

The decode grid written is a plane fitted through the medians (``fixed + per_seq*B +
per_kv_token*B*C``, outliers dropped; see :func:`smooth_decode`), the medians themselves kept
beside it: on two shared cores a single point can catch a burst of another process's work.
Every run uses prompts not seen before (seeded random token ids), so vLLM's prefix cache never
shortens one. Each point is the median of ``repeats`` after ``warmup``. The profile also records
the engine's real limits (``num_gpu_blocks``, ``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``) under ``calibration``, so a sim replica can be
given the same ones. vLLM is imported lazily: this module loads without it.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

import numpy as np

from serving.engine.vllm_engine import VllmEngineConfig

DECODE_TOKENS = 16
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FIRST_TOKEN_ID = 3  # past the tiny tokenizer's special tokens


class Grid(Protocol):
    """Where to time (``bench.calibrate.Grid``; a protocol, so no import cycle)."""

    @property
    def batches(self) -> tuple[int, ...]: ...
    @property
    def contexts(self) -> tuple[int, ...]: ...
    @property
    def prefill_lengths(self) -> tuple[int, ...]: ...
    @property
    def repeats(self) -> int: ...
    @property
    def warmup(self) -> int: ...


@dataclass(frozen=True)
class EngineLimits:
    """The limits vLLM actually runs with: what a sim must be given to schedule the same way."""

    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def as_dict(self) -> dict[str, int]:
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
        }


def decode_step_ms(with_decode_s: float, first_token_s: float, steps: int) -> float:
    """One decode step from two timings that differ by ``steps`` decode steps (never negative)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return max(0.0, (with_decode_s - first_token_s) * 1000.0 / steps)


def llama_params(hf_config: Any) -> int:
    """Parameters of a Llama-architecture model from its config (embeddings, attention, MLP,
    norms, and the LM head unless tied)."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads))
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    inter = int(hf_config.intermediate_size)
    vocab = int(hf_config.vocab_size)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if getattr(hf_config, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(hf_config.num_hidden_layers) * layer + hidden + head


def kv_bytes_per_token(hf_config: Any, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads))
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return 2 * int(hf_config.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


class _Prompts:
    """Fresh seeded random prompts: no two runs share a prefix the cache could reuse."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab

    def batch(self, count: int, length: int) -> list[list[int]]:
        ids = self._rng.integers(FIRST_TOKEN_ID, self._vocab, size=(count, max(1, length)))
        return [row.tolist() for row in ids]


def _median_s(run: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(repeats))


def check_fits(grid: Grid, max_model_len: int, steps: int = DECODE_TOKENS) -> None:
    """Refuse a grid whose sequences would not fit the engine's context."""
    longest = max(max(grid.contexts) + steps, max(grid.prefill_lengths) + 1)
    if longest > max_model_len:
        raise ValueError(
            f"the grid needs {longest} tokens per sequence but max_model_len is "
            f"{max_model_len}; lower --contexts/--prefill or raise max_model_len"
        )


# run(count, length, tokens): seconds for ``count`` fresh requests of ``length`` prompt tokens,
# sent together, each generating ``tokens`` tokens, until the last one ends.
BatchTimer = Callable[[int, int, int], float]


@dataclass(frozen=True)
class StepTimes:
    """Measured step times: decode ms per (batch, context), prefill ms per length."""

    decode: dict[tuple[int, int], float]
    prefill: dict[int, float]


def measure(
    run: BatchTimer, grid: Grid, steps: int = DECODE_TOKENS, progress: TextIO | None = sys.stdout
) -> StepTimes:
    """The grid timed with ``run`` as the module docstring says (any way of running batches)."""
    return StepTimes(_decode_grid(run, grid, steps, progress), _prefill_points(run, grid, progress))


OUTLIER_FACTOR = 3.0
OUTLIER_FLOOR_MS = 0.05
MAX_DROPPED_FRACTION = 1 / 3
MIN_STEP_MS = 1e-3
Point = tuple[int, int, float]


def _row(b: int, c: int) -> np.ndarray:
    return np.array([1.0, b, b * c])


def _fit(points: Sequence[Point]) -> np.ndarray | None:
    """Least squares of ms over (1, batch, batch x context) with no negative coefficient (a
    step never gets cheaper with more sequences or context): a term that comes out negative is
    dropped and the rest refitted. None where the points cannot determine all three."""
    x = np.array([_row(b, c) for b, c, _ in points])
    y = np.array([ms for _, _, ms in points])
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    active = list(range(x.shape[1]))
    while True:
        solved = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if solved.min() >= 0 or len(active) == 1:
            coeffs = np.zeros(x.shape[1])
            coeffs[active] = solved
            return coeffs
        del active[int(np.argmin(solved))]


def _leave_one_out(points: Sequence[Point]) -> list[float] | None:
    """Each point's distance from the plane fitted through all the others."""
    errors = []
    for i, (b, c, ms) in enumerate(points):
        coeffs = _fit([*points[:i], *points[i + 1 :]])
        if coeffs is None:
            return None
        errors.append(abs(ms - float(coeffs @ _row(b, c))))
    return errors


def smooth_decode(decode: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Decode step times on a fitted plane ``fixed + per_seq*B + per_kv_token*B*C``.

    On two shared cores one point can catch another process's burst. Outliers go first, one at
    a time (at most a third of the grid): the point farthest from the plane fitted through the
    others, while that distance is over OUTLIER_FACTOR times the others' median (leave-one-out,
    so a wild point at the grid's corner cannot drag the plane to itself). A grid that cannot
    determine the plane (one batch size, or one context) is kept as measured."""
    kept = [(b, c, ms) for (b, c), ms in decode.items()]
    if _fit(kept) is None:
        return dict(decode)
    for _ in range(int(len(kept) * MAX_DROPPED_FRACTION)):
        errors = _leave_one_out(kept)
        if errors is None:
            break
        worst = int(np.argmax(errors))
        others = errors[:worst] + errors[worst + 1 :]
        if errors[worst] <= max(OUTLIER_FLOOR_MS, OUTLIER_FACTOR * float(np.median(others))):
            break
        del kept[worst]
    coeffs = _fit(kept)
    assert coeffs is not None  # the loop only drops points while the rest determine the plane
    return {(b, c): max(MIN_STEP_MS, float(coeffs @ _row(b, c))) for b, c in decode}


@dataclass(frozen=True)
class ModelFigures:
    """What the profile records of the model besides timings."""

    params: int
    dtype_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, hf_config: Any, dtype_bytes: int) -> ModelFigures:
        return cls(llama_params(hf_config), dtype_bytes, kv_bytes_per_token(hf_config, dtype_bytes))

    def entry(self, times: StepTimes) -> dict[str, Any]:
        """The profile's ``models.<name>`` entry for these step times: the decode grid smoothed
        (:func:`smooth_decode`; the raw medians kept as ``decode_step_measured_ms``)."""
        weight_bytes = self.params * self.dtype_bytes
        smoothed = smooth_decode(times.decode)
        return {
            "params": self.params,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "decode_step_measured_ms": {
                f"{b}x{c}": round(ms, 4) for (b, c), ms in times.decode.items()
            },
            "decode_step_graph_ms": {
                f"{b}x{c}": {
                    "ms": round(ms, 4),
                    "bytes": weight_bytes + b * c * self.kv_bytes_per_token,
                    "flops": 2 * self.params * b,
                }
                for (b, c), ms in smoothed.items()
            },
            "prefill_graph_ms": {str(n): round(ms, 4) for n, ms in times.prefill.items()},
        }


def calibrate_vllm(
    config: VllmEngineConfig,
    grid: Grid,
    *,
    steps: int = DECODE_TOKENS,
    progress: TextIO | None = sys.stdout,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time vLLM's engine as the module docstring says; returns (profile entry, run metadata)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.platforms import current_platform

    on_cpu = bool(current_platform.is_cpu())
    args = config.engine_args(on_cpu)
    llm = LLM(**args)
    try:
        vconf = llm.llm_engine.vllm_config
        limits = EngineLimits(
            num_gpu_blocks=int(vconf.cache_config.num_gpu_blocks or 0),
            block_size=int(vconf.cache_config.block_size),
            max_num_seqs=int(vconf.scheduler_config.max_num_seqs),
            max_num_batched_tokens=int(vconf.scheduler_config.max_num_batched_tokens),
            max_model_len=int(vconf.model_config.max_model_len),
        )
        check_fits(grid, limits.max_model_len, steps)
        prompts = _Prompts(int(vconf.model_config.get_vocab_size()), config.seed)

        def run(count: int, length: int, tokens: int) -> float:
            batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts.batch(count, length)]
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            started = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - started

        times = measure(run, grid, steps, progress)
    finally:
        llm.llm_engine.engine_core.shutdown()
    figures = ModelFigures.of(vconf.model_config.hf_config, int(vconf.model_config.dtype.itemsize))
    meta = {
        "device": platform.processor() or platform.machine() or "cpu",
        "vllm": vllm.__version__,
        "dtype": str(vconf.model_config.dtype).removeprefix("torch."),
        "calibration": {
            "engine": "vllm",
            "on_cpu": on_cpu,
            "engine_args": {k: v for k, v in args.items() if k != "model"},
            "limits": limits.as_dict(),
            "decode_tokens": steps,
            "statistic": f"median of {grid.repeats} after {grid.warmup} warmup",
            "method": "offline vllm.LLM: decode (generate k+1 - generate 1) / k at mean "
            "context C; prefill: one request generating one token",
        },
    }
    return figures.entry(times), meta


def _say(progress: TextIO | None, text: str) -> None:
    print(f"calibrate vllm: {text}", file=progress, flush=True)


def _decode_grid(
    run: BatchTimer, grid: Grid, steps: int, progress: TextIO | None
) -> dict[tuple[int, int], float]:
    """Decode step ms per (batch, context), prompts starting ``steps/2`` before the context."""
    decode: dict[tuple[int, int], float] = {}
    for b, c in itertools.product(grid.batches, grid.contexts):
        start = max(1, c - steps // 2)

        def one(b: int = b, start: int = start) -> float:
            first = run(b, start, 1)
            return decode_step_ms(run(b, start, steps + 1), first, steps)

        decode[(b, c)] = _median_s(one, grid.warmup, grid.repeats)
        _say(progress, f"decode batch {b} context {c}: {decode[(b, c)]:.3f} ms")
    return decode


def _prefill_points(run: BatchTimer, grid: Grid, progress: TextIO | None) -> dict[int, float]:
    """Prefill ms per length: one request's whole first-token step."""
    prefill: dict[int, float] = {}
    for length in grid.prefill_lengths:

        def one(length: int = length) -> float:
            return run(1, length, 1) * 1000.0

        ms = _median_s(one, grid.warmup, grid.repeats)
        prefill[length] = ms
        _say(progress, f"prefill {length} tokens: {ms:.3f} ms")
    return prefill
