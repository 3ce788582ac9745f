"""Measure a real engine's step times and write them as a profile the sim engine loads.

    zl-bench calibrate --engine torch --engine-option model_shape=tiny \
        --engine-option device=cpu --out P

Decode steps are timed over a grid of batch x context, prefill over lengths (batch 1), each the
median of ``--repeats`` runs after ``--warmup``, through the torch engine's own step runner (CUDA
graphs for decode on CUDA, as the engine runs them), so host-side batch preparation is included.
The output has the shared profile's format (``models.<name>.{params, weight_bytes,
kv_bytes_per_token, decode_step_graph_ms, prefill_graph_ms}``); an existing file at ``--out``
keeps its other models, so one file can hold several. Then ``SimConfig(profile_path=P,
model_shape=name)`` runs the sim on this machine's timings.

With ``--engine vllm --engine-option model=DIR`` the real vLLM's steps are timed through its own
engine instead (``bench.calibrate_vllm`` says how), on a small grid sized for the tiny
model on two cores, and its real limits (KV blocks, block size, batch limits) go into the file.

This module has no program of its own: ``zl-bench calibrate`` calls :func:`add_arguments` and
:func:`run_command`, which raises ValueError for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.calibrate_vllm import DECODE_TOKENS, check_fits
from harness.errors import UsageError
from harness.outputs import output_file
from harness.promptfit import context_length
from serving.engine import engine_kind
from serving.engine.options import add_engine_option, validate_engine_options

if TYPE_CHECKING:
    import torch

    from serving.engine.kv import KVBlockManager
    from serving.engine.torch_engine.engine import TorchEngineConfig
    from serving.engine.torch_engine.model import LlamaShape
    from serving.engine.torch_engine.runner import ModelRunner
    from serving.engine.torch_engine.step import SeqSlice

MIN_PREFILL_POINTS = 3


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, sorted, without repeats."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    return tuple(values)


@dataclass(frozen=True)
class Grid:
    """Where to time steps: decode at every batch x context, prefill at every length."""

    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (128, 512, 2048)
    prefill_lengths: tuple[int, ...] = (128, 512, 2048)
    repeats: int = 5
    warmup: int = 2

    def __post_init__(self) -> None:
        for name in ("batches", "contexts", "prefill_lengths"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {values}")
        if len(set(self.prefill_lengths)) < MIN_PREFILL_POINTS:
            raise ValueError(
                f"the sim's prefill model needs at least {MIN_PREFILL_POINTS} prefill lengths, "
                f"got {len(set(self.prefill_lengths))}"
            )
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"need repeats >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}"
            )


def _time_ms(step: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


@dataclass(frozen=True)
class _TorchRig:
    """The torch engine's model, paged KV blocks and step runner, sized for one grid."""

    shape: LlamaShape
    device: torch.device
    dtype: torch.dtype
    manager: KVBlockManager
    runner: ModelRunner

    def slices(self, count: int, context: int, tokens: int) -> list[SeqSlice]:
        """``count`` sequences of ``context`` cached tokens, each computing ``tokens`` more."""
        from serving.engine.torch_engine.step import SeqSlice

        out = []
        for i in range(count):
            seq = f"s{i}"
            self.manager.append(seq, context + tokens)
            ids = [(7 * i + j) % self.shape.vocab_size for j in range(tokens)]
            out.append(SeqSlice(seq, ids, context, True, self.manager.block_table(seq)))
        return out

    def time_ms(self, slices: list[SeqSlice], grid: Grid) -> float:
        """The median time of one step over ``slices``, whose blocks are then freed."""
        ms = _time_ms(partial(self.runner.execute, slices), grid.warmup, grid.repeats)
        for s in slices:
            self.manager.free(s.seq_id)
        return ms


def _torch_rig(config: TorchEngineConfig, grid: Grid) -> _TorchRig:
    """A model and enough KV blocks for the grid's largest batch at its longest context."""
    from serving.engine.kv import KVBlockManager
    from serving.engine.torch_engine.kv_paged import PagedKVPool
    from serving.engine.torch_engine.model import build_model, get_shape
    from serving.engine.torch_engine.runner import ModelRunner

    shape = get_shape(config.model_shape)
    dev = config.torch_device()
    dt = config.torch_dtype(dev)
    block = config.block_size
    longest = max(max(grid.contexts) + 1, max(grid.prefill_lengths))
    width = -(-longest // block)
    num_blocks = max(max(grid.batches) * width, width)
    model = build_model(shape, longest, dev, dt, config.seed, config.weights_path)
    pool = PagedKVPool(shape, num_blocks, block, dev, dt)
    runner = ModelRunner(model, pool, max(grid.batches), width, config.cuda_graphs)
    return _TorchRig(shape, dev, dt, KVBlockManager(num_blocks, block), runner)


def _decode_points(rig: _TorchRig, grid: Grid) -> dict[str, dict[str, float]]:
    """Each decode step of the grid (``BxC``): its time, and the bytes and flops it moves."""
    wbytes = rig.dtype.itemsize
    kv_per_token = rig.shape.kv_bytes_per_token(wbytes)
    params = rig.shape.non_embedding_params
    decode: dict[str, dict[str, float]] = {}
    for b in grid.batches:
        for c in grid.contexts:
            ms = rig.time_ms(rig.slices(b, c, 1), grid)
            decode[f"{b}x{c}"] = {
                "ms": round(ms, 4),
                "bytes": params * wbytes + b * c * kv_per_token,
                "flops": 2 * params * b,
            }
    return decode


def _torch_meta(rig: _TorchRig, grid: Grid) -> dict[str, Any]:
    """What the profile records of the run: the device, torch, dtype and how it was timed."""
    import torch

    dev = rig.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    return {
        "device": device_name or dev.type,
        "torch": torch.__version__,
        "dtype": str(rig.dtype).removeprefix("torch."),
        "calibration": {
            "engine": "torch",
            "kv_layout": "paged",
            "cuda_graphs": rig.runner.graphs is not None,
            "statistic": f"median of {grid.repeats} after {grid.warmup} warmup",
            "includes_host_prep": True,
        },
    }


def calibrate_torch(config: TorchEngineConfig, grid: Grid) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time the torch engine's steps (paged KV, as ``config`` sets the model, device, dtype,
    weights, seed and CUDA graphs); returns (the model's profile entry, run metadata)."""
    rig = _torch_rig(config, grid)
    decode = _decode_points(rig, grid)
    prefill = {
        str(length): round(rig.time_ms(rig.slices(1, 0, length), grid), 4)
        for length in grid.prefill_lengths
    }
    wbytes = rig.dtype.itemsize
    entry = {
        "params": rig.shape.params,
        "weight_bytes": rig.shape.params * wbytes,
        "kv_bytes_per_token": rig.shape.kv_bytes_per_token(wbytes),
        "decode_step_graph_ms": decode,
        "prefill_graph_ms": prefill,
    }
    return entry, _torch_meta(rig, grid)


def write_profile(path: Path, name: str, entry: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write (or add to) a profile file; other models already in it are kept."""
    profile: dict[str, Any] = {}
    if path.exists():
        profile = json.loads(path.read_text())
    profile.update(meta)
    profile.setdefault("models", {})[name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench calibrate``'s arguments; engine settings are ``--engine-option`` as everywhere."""
    parser.add_argument(
        "--engine", choices=sorted(CALIBRATORS), default="torch", help="engine to time"
    )
    add_engine_option(parser)
    parser.add_argument(
        "--name", help="model name in the profile; unset: the model shape (vllm: vllm-DIRNAME)"
    )
    parser.add_argument("--batches", type=_ints, help="decode batch sizes (unset: the engine's)")
    parser.add_argument("--contexts", type=_ints, help="decode contexts (unset: the engine's)")
    parser.add_argument("--prefill", type=_ints, help="prefill lengths, 3 or more (unset: ditto)")
    parser.add_argument("--repeats", type=int, help="timed runs per point (unset: the engine's)")
    parser.add_argument("--warmup", type=int, help="untimed runs per point (unset: the engine's)")
    parser.add_argument("--out", required=True, type=Path, help="profile file to write or add to")


def fit_points(points: tuple[int, ...], limit: int, least: int = 1) -> tuple[int, ...]:
    """``points`` no longer than ``limit``: those past it replaced by ``limit`` itself, then, if
    fewer than ``least`` are left, points a quarter, a sixteenth ... of it added below."""
    if limit < 1:
        raise ValueError(f"a context of {limit} tokens leaves no point to time")
    kept = {p for p in points if p <= limit}
    if len(kept) < len(points):
        kept.add(limit)
    below = limit
    while len(kept) < least and below > 1:
        below = max(1, below // 4)
        kept.add(below)
    return tuple(sorted(kept))


def fit_grid(
    grid: Grid, context: int | None, given: frozenset[str] = frozenset()
) -> tuple[Grid, list[str]]:
    """``grid`` inside an engine's context (``max_model_len``): the decode contexts and the
    prefill lengths the command line did not give (``given``: ``contexts``, ``prefill``) fitted
    with :func:`fit_points` so every sequence (``DECODE_TOKENS`` past a decode context, one past
    a prefill) fits; what the command line gave is checked, not changed (ValueError). Says what
    was fitted, a line per part."""
    if context is None:
        return grid, []
    contexts, prefill = grid.contexts, grid.prefill_lengths
    if "contexts" not in given:
        contexts = fit_points(contexts, context - DECODE_TOKENS)
    if "prefill" not in given:
        prefill = fit_points(prefill, context - 1, MIN_PREFILL_POINTS)
    fitted = dataclasses.replace(grid, contexts=contexts, prefill_lengths=prefill)
    check_fits(fitted, context)
    lines = [
        f"{name} {','.join(map(str, before))} -> {','.join(map(str, after))}, fitted to "
        f"max_model_len {context}"
        for name, before, after in (
            ("decode contexts", grid.contexts, contexts),
            ("prefill lengths", grid.prefill_lengths, prefill),
        )
        if before != after
    ]
    return fitted, lines


def grid_from_args(args: argparse.Namespace) -> Grid:
    """The grid asked for, each unset part taken from the engine's default grid."""
    base = CALIBRATORS[args.engine].grid
    return Grid(
        args.batches or base.batches,
        args.contexts or base.contexts,
        args.prefill or base.prefill_lengths,
        base.repeats if args.repeats is None else args.repeats,
        base.warmup if args.warmup is None else args.warmup,
    )


def check_out(out: Path) -> None:
    """Refuse an output path that cannot take a profile (a directory, a path under a file or
    that cannot be written, a file that is not JSON)."""
    try:
        output_file(out)
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    if out.exists():
        try:
            json.loads(out.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--out {out} is not a profile to add to: {exc}") from None


def run_command(args: argparse.Namespace) -> int:
    """Calibrate and write the profile; ValueError for bad input (options, model, grid, output
    path). The engine's options are fitted to the model they name and the grid's default parts
    to its context, each said in a line."""
    out: Path = args.out
    check_out(out)
    options = validate_engine_options(args.engine, dict(args.engine_options))
    asked = grid_from_args(args)
    fit = engine_kind(args.engine).fit_to_model(options)
    given = frozenset(part for part in ("contexts", "prefill") if getattr(args, part))
    grid, lines = fit_grid(asked, context_length(fit.options), given)
    for line in [*fit.notes, *lines]:
        print(f"calibrate: {line}", flush=True)
    name, entry, meta = CALIBRATORS[args.engine].calibrate(fit.options, grid, args.name)
    write_profile(out, name, entry, meta)
    points = len(entry["decode_step_graph_ms"]) + len(entry["prefill_graph_ms"])
    print(f"wrote {name} ({points} points) to {out}")
    return 0


def vllm_profile_name(model: str) -> str:
    """The default model name of a vLLM calibration: ``vllm-`` and the model directory's name."""
    return f"vllm-{Path(model).name}"


def _calibrate_vllm(
    options: dict[str, Any], grid: Grid, name: str | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Calibrate the real vLLM; ValueError when there is no model directory or no vLLM."""
    from bench.calibrate_vllm import calibrate_vllm
    from serving.engine.vllm_engine import VllmEngineConfig

    config = VllmEngineConfig(**options)
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vllm is not installed (the CPU build installs with: nox -s vllm)")
    entry, meta = calibrate_vllm(config, grid)
    return name or vllm_profile_name(config.model), entry, meta


def _calibrate_torch_engine(
    options: dict[str, Any], grid: Grid, name: str | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Calibrate the torch engine; the profile's model is named after its shape by default."""
    from serving.engine.torch_engine.engine import TorchEngineConfig

    config = TorchEngineConfig(**options)
    entry, meta = calibrate_torch(config, grid)
    return name or config.model_shape, entry, meta


@dataclass(frozen=True)
class Calibrator:
    """How one engine's steps are timed: its default grid, and the run that times them (engine
    options, grid, profile name or None) into (name, profile entry, metadata)."""

    grid: Grid
    calibrate: Callable[
        [dict[str, Any], Grid, str | None], tuple[str, dict[str, Any], dict[str, Any]]
    ]


# The engines ``zl-bench calibrate`` times. Grids sized for each: the torch engine's shapes, and
# the tiny model under the CPU vLLM (the contexts and prompt lengths profiles A and C reach on
# it; about a minute on two cores).
CALIBRATORS: dict[str, Calibrator] = {
    "torch": Calibrator(Grid(), _calibrate_torch_engine),
    "vllm": Calibrator(
        Grid(
            batches=(1, 4, 16),
            contexts=(128, 1024, 3072),
            prefill_lengths=(128, 1024, 3072),
            repeats=3,
            warmup=1,
        ),
        _calibrate_vllm,
    ),
}
