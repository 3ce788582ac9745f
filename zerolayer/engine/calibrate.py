"""Measure a real engine's step times and write them as a profile the sim engine loads.

    python -m zerolayer.engine.calibrate --engine torch --model-shape tiny --device cpu --out P

Decode steps are timed over a grid of batch x context, prefill over lengths (batch 1), each the
median of ``--repeats`` runs after ``--warmup``, through the torch engine's own step runner (CUDA
graphs for decode on CUDA, as the engine runs them), so host-side batch preparation is included.
The output has the shared profile's format (``models.<name>.{params, weight_bytes,
kv_bytes_per_token, decode_step_graph_ms, prefill_graph_ms}``); an existing file at ``--out``
keeps its other models, so one file can hold several. Then ``SimConfig(profile_path=P,
model_shape=name)`` runs the sim on this machine's timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _ints(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _time_ms(step: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)


def calibrate_torch(
    model_shape: str,
    device: str,
    dtype: str,
    batches: Sequence[int],
    contexts: Sequence[int],
    prefill_lengths: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
    cuda_graphs: bool = True,
    weights_path: str | None = None,
    seed: int = 0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time the torch engine's steps; returns (the model's profile entry, run metadata)."""
    import torch

    from zerolayer.engine.torch_engine.engine import TorchEngineConfig
    from zerolayer.engine.torch_engine.kv_paged import PagedBlockManager, PagedKVPool
    from zerolayer.engine.torch_engine.model import build_model, get_shape
    from zerolayer.engine.torch_engine.runner import ModelRunner
    from zerolayer.engine.torch_engine.step import SeqSlice

    if len(prefill_lengths) < 3:
        raise ValueError("the sim's prefill model needs at least three prefill lengths")
    config = TorchEngineConfig(model_shape=model_shape, device=device, dtype=dtype)
    shape = get_shape(model_shape)
    dev = config.torch_device()
    dt = config.torch_dtype(dev)
    block = config.block_size
    longest = max(max(contexts) + 1, max(prefill_lengths))
    width = -(-longest // block)
    num_blocks = max(max(batches) * width, width)
    model = build_model(shape, longest, dev, dt, seed, weights_path)
    manager = PagedBlockManager(num_blocks, block)
    pool = PagedKVPool(shape, num_blocks, block, dev, dt)
    runner = ModelRunner(model, pool, max(batches), width, cuda_graphs)

    def slices_for(count: int, context: int, tokens: int) -> list[SeqSlice]:
        out = []
        for i in range(count):
            seq = f"s{i}"
            manager.append(seq, context + tokens)
            ids = [(7 * i + j) % shape.vocab_size for j in range(tokens)]
            out.append(SeqSlice(seq, ids, context, True, manager.block_table(seq)))
        return out

    def release(slices: list[SeqSlice]) -> None:
        for s in slices:
            manager.free(s.seq_id)

    wbytes = dt.itemsize
    kv_per_token = shape.kv_bytes_per_token(wbytes)
    decode: dict[str, dict[str, float]] = {}
    for b in batches:
        for c in contexts:
            slices = slices_for(b, c, 1)
            ms = _time_ms(lambda s=slices: runner.execute(s), warmup, repeats)
            release(slices)
            decode[f"{b}x{c}"] = {
                "ms": round(ms, 4),
                "bytes": shape.non_embedding_params * wbytes + b * c * kv_per_token,
                "flops": 2 * shape.non_embedding_params * b,
            }
    prefill: dict[str, float] = {}
    for length in prefill_lengths:
        slices = slices_for(1, 0, length)
        prefill[str(length)] = round(
            _time_ms(lambda s=slices: runner.execute(s), warmup, repeats), 4
        )
        release(slices)
    entry = {
        "params": shape.params,
        "weight_bytes": shape.params * wbytes,
        "kv_bytes_per_token": kv_per_token,
        "decode_step_graph_ms": decode,
        "prefill_graph_ms": prefill,
    }
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    meta = {
        "device": device_name or dev.type,
        "torch": torch.__version__,
        "dtype": str(dt).removeprefix("torch."),
        "calibration": {
            "engine": "torch",
            "kv_layout": "paged",
            "cuda_graphs": runner.graphs is not None,
            "statistic": f"median of {repeats} after {warmup} warmup",
            "includes_host_prep": True,
        },
    }
    return entry, meta


def write_profile(path: Path, name: str, entry: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write (or add to) a profile file; other models already in it are kept."""
    profile: dict[str, Any] = {}
    if path.exists():
        profile = json.loads(path.read_text())
    profile.update(meta)
    profile.setdefault("models", {})[name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerolayer.engine.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engine", choices=["torch"], default="torch")
    parser.add_argument("--model-shape", default="tiny")
    parser.add_argument("--name", help="model name in the profile (default: the shape name)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", help="local safetensors file or directory")
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16])
    parser.add_argument("--contexts", type=_ints, default=[128, 512, 2048])
    parser.add_argument("--prefill", type=_ints, default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    entry, meta = calibrate_torch(
        args.model_shape,
        args.device,
        args.dtype,
        args.batches,
        args.contexts,
        args.prefill,
        repeats=args.repeats,
        warmup=args.warmup,
        cuda_graphs=not args.no_cuda_graphs,
        weights_path=args.weights,
    )
    name = args.name or args.model_shape
    write_profile(args.out, name, entry, meta)
    points = len(entry["decode_step_graph_ms"]) + len(entry["prefill_graph_ms"])
    print(f"wrote {name} ({points} points) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
