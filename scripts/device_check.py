"""The GPU check of issue 8, run by ``scripts/device_check.sh`` (about 6-8 minutes on one H200).

1. A zero-layer replica (``zl-replica --engine torch --engine-option model_shape=llama-3.2-1b``,
   paged KV, CUDA graphs) driven over h2c by the native loader at two constant rates; NVML
   utilisation and memory sampled every 250 ms throughout.
2. The same engine in-process with each KV layout (paged, contiguous), driven at the higher rate
   through the native loader's in-process sender, sampling the engine's stats (KV waste, and the
   caching allocator's ``inactive_split_bytes / reserved_bytes`` and ``num_alloc_retries``).
3. If time is left, a bounded calibration of llama-3.2-1b, to compare with the shared profile.

Everything goes under ``--out``: ``telemetry.jsonl`` (one row per sample, with its phase),
``records-*.jsonl`` (one per request), ``summary.json`` (the figures for the closing note).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from harness.loaders.native import run_schedule
from harness.loaders.senders import client_sender, engine_sender
from harness.stacks import ReplicaProcess, client_for
from harness.telemetry.nvml import NvmlSource
from harness.workload import PlannedRequest

SHAPE = "llama-3.2-1b"
SAMPLE_S = 0.25
DEADLINE_S = 15.0


def schedule(rate: float, duration_s: float, tag: str) -> list[PlannedRequest]:
    """Profile A's request (1 KB prompt, 128 tokens) at a constant rate: bounded in count."""
    count = int(rate * duration_s)
    return [
        PlannedRequest(
            i,
            f"{tag}-{i}",
            i / rate,
            "A",
            1024,
            128,
            i,
            f"s{i % 64}",
            "t0",
            "normal",
            int(DEADLINE_S * 1000),
        )
        for i in range(count)
    ]


class Telemetry:
    """Samples NVML (and an engine's stats, when given) on an absolute schedule into JSONL."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")
        self.nvml = NvmlSource()
        self.available = self.nvml.open()
        self.phase = "idle"
        self.engine: Any = None
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            row: dict[str, Any] = {"ts_ns": time.time_ns(), "phase": self.phase}
            if self.available.ok:
                row["gpus"] = self.nvml.read()
            engine = self.engine
            if engine is not None:
                stats = engine.stats()
                row["engine"] = {
                    "running": stats.running,
                    "waiting": stats.waiting,
                    "kv_usage": stats.kv_usage,
                    "kv_waste": stats.kv_waste,
                    "preemptions": stats.preemptions,
                    "allocator": stats.allocator,
                }
            self.rows.append(row)
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            next_at += SAMPLE_S
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def phase_rows(self, phase: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["phase"] == phase]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.file.close()


def gpu_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean and max GPU utilisation and the peak memory used over a phase's samples."""
    gpus = [g for r in rows for g in r.get("gpus", [])]
    util = [g["gpu_util_pct"] for g in gpus if g.get("gpu_util_pct") is not None]
    mem = [g["mem_used_bytes"] for g in gpus if g.get("mem_used_bytes") is not None]
    return {
        "samples": len(rows),
        "gpu_util_pct_mean": sum(util) / len(util) if util else float("nan"),
        "gpu_util_pct_max": max(util, default=float("nan")),
        "mem_used_bytes_peak": max(mem, default=float("nan")),
    }


def engine_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    eng = [r["engine"] for r in rows if "engine" in r]
    frag = [e["allocator"].get("fragmentation", 0.0) for e in eng]
    return {
        "kv_waste_mean": sum(e["kv_waste"] for e in eng) / len(eng) if eng else float("nan"),
        "fragmentation_mean": sum(frag) / len(frag) if frag else float("nan"),
        "fragmentation_max": max(frag, default=float("nan")),
        "inactive_split_bytes_peak": max(
            (e["allocator"].get("inactive_split_bytes_peak", 0.0) for e in eng), default=0.0
        ),
        "num_alloc_retries": max(
            (e["allocator"].get("num_alloc_retries", 0.0) for e in eng), default=0.0
        ),
        "reserved_bytes_max": max(
            (e["allocator"].get("reserved_bytes", 0.0) for e in eng), default=0.0
        ),
        "preemptions": max((e["preemptions"] for e in eng), default=0),
    }


async def replica_phase(out: Path, tel: Telemetry, rates: list[float], seconds: float) -> dict:
    results: dict[str, Any] = {}
    replica = ReplicaProcess(
        "torch",
        {
            "model_shape": SHAPE,
            "max_num_seqs": 128,
            "max_model_len": 4096,
            "device": "cuda",
            "kv_layout": "paged",
        },
        ready_timeout_s=120,
    )
    try:
        for rate in rates:
            phase = f"replica-paged-{rate:g}rps"
            tel.phase = phase
            async with client_for("h2", [replica.url], grace_ms=5000) as client:
                result = await run_schedule(
                    schedule(rate, seconds, phase),
                    client_sender(client),
                    stack="zerolayer",
                    profile=phase,
                    records_path=out / f"records-{phase}.jsonl",
                    progress=None,
                )
            tel.phase = "idle"
            results[phase] = {"load": result.summary, "gpu": gpu_summary(tel.phase_rows(phase))}
    finally:
        replica.kill()
    return results


async def layout_phase(out: Path, tel: Telemetry, layout: str, rate: float, seconds: float) -> dict:
    from serving.engine.torch_engine import TorchEngine, TorchEngineConfig

    engine = TorchEngine(
        TorchEngineConfig(
            model_shape=SHAPE, kv_layout=layout, device="cuda", max_num_seqs=128, max_model_len=4096
        )
    )
    phase = f"engine-{layout}-{rate:g}rps"
    try:
        tel.engine = engine
        tel.phase = phase
        result = await run_schedule(
            schedule(rate, seconds, phase),
            engine_sender(engine),
            stack=f"torch-{layout}",
            profile=phase,
            records_path=out / f"records-{phase}.jsonl",
        )
        tel.phase = "idle"
        rows = tel.phase_rows(phase)
        return {"load": result.summary, "gpu": gpu_summary(rows), "engine": engine_summary(rows)}
    finally:
        tel.engine = None
        await engine.close()
        del engine
        import torch

        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", default="4,16", help="two request rates (requests/s)")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of each load phase")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip calibration past it")
    args = parser.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    tel = Telemetry(args.out / "telemetry.jsonl")
    summary: dict[str, Any] = {"nvml": tel.available.ok, "shape": SHAPE}
    try:
        summary.update(asyncio.run(replica_phase(args.out, tel, rates, args.seconds)))
        for layout in ("paged", "contiguous"):
            summary[f"engine-{layout}"] = asyncio.run(
                layout_phase(args.out, tel, layout, max(rates), args.seconds)
            )
        if time.monotonic() - started < args.budget_s - 60:
            from bench.calibrate import add_arguments, run_command

            calibrate = argparse.ArgumentParser(prog="calibrate")
            add_arguments(calibrate)
            run_command(
                calibrate.parse_args(
                    [
                        "--engine",
                        "torch",
                        "--engine-option",
                        f"model_shape={SHAPE}",
                        "--engine-option",
                        "device=cuda",
                        "--batches",
                        "1,8,32",
                        "--contexts",
                        "512,2048",
                        "--prefill",
                        "300,3000,12000",
                        "--out",
                        str(args.out / "h200-torch-calibrated.json"),
                    ]
                )
            )
    finally:
        tel.close()
        summary["elapsed_s"] = round(time.monotonic() - started, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
