"""Drive the sim engine in-process and check it keeps the time its step model promises.

``zl-bench fidelity``, the engine's own calibration check: step durations as modelled against as
slept, cumulative drift, throughput and TTFT, with the engine's CPU share of one core.
``zl-bench fidelity --against vllm --engine-option model=DIR`` instead checks the sim's latencies
against the real vLLM's on the same load (``bench.fidelity_vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvloop

from harness.errors import UsageError
from harness.profile import SCALES
from serving.cliargs import positive_int
from serving.engine import EngineRequest, SimConfig, SimEngine
from serving.engine.options import add_engine_option, validate_engine_options

PROMPT_TOKENS_1KB = 256


@dataclass(frozen=True, slots=True)
class FidelityResult:
    """What one fidelity drive measured."""

    requests: int
    completed_tokens: int
    wall_s: float
    cpu_share: float
    median_step_ratio: float
    median_modelled_ms: float
    median_actual_ms: float
    drift: float
    timing_resets: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_throughput: float

    def lines(self) -> list[str]:
        return [
            f"requests={self.requests} output_tokens={self.completed_tokens} "
            f"wall={self.wall_s:.2f}s output_throughput={self.output_throughput:.0f} tok/s",
            f"ttft p50={self.ttft_p50_ms:.1f} ms p99={self.ttft_p99_ms:.1f} ms",
            f"step duration median: modelled={self.median_modelled_ms:.3f} ms "
            f"actual={self.median_actual_ms:.3f} ms ratio={self.median_step_ratio:.4f}",
            f"cumulative drift={self.drift * 100:+.3f} % timing_resets={self.timing_resets} "
            f"process cpu={self.cpu_share * 100:.1f} % of one core",
        ]


async def drive(
    config: SimConfig, requests: int, prompt_tokens: int, max_tokens: int
) -> FidelityResult:
    """Send ``requests`` requests at once and consume every stream."""
    engine = SimEngine(config)
    ttfts: list[float] = []

    async def one(i: int) -> int:
        start = time.perf_counter()
        first = True
        n = 0
        async for chunk in engine.generate(EngineRequest(f"r{i}", prompt_tokens, max_tokens, i)):
            if first and chunk.token_ids:
                ttfts.append((time.perf_counter() - start) * 1000)
                first = False
            n += len(chunk.token_ids)
        return n

    wall0, cpu0 = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(i) for i in range(requests)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await engine.close()
    steps = list(engine.timings)
    ttfts.sort()
    return FidelityResult(
        requests=requests,
        completed_tokens=sum(counts),
        wall_s=wall,
        cpu_share=cpu / wall,
        median_step_ratio=statistics.median(s.actual_s / s.modelled_s for s in steps),
        median_modelled_ms=statistics.median(s.modelled_s for s in steps) * 1000,
        median_actual_ms=statistics.median(s.actual_s for s in steps) * 1000,
        drift=engine.drift(),
        timing_resets=engine.timing_resets,
        ttft_p50_ms=ttfts[len(ttfts) // 2],
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        output_throughput=sum(counts) / wall,
    )


def _against_vllm(args: argparse.Namespace) -> int:
    from bench.fidelity_vllm import run_command

    return run_command(args)


# What ``--against`` can check the sim against: each a command taking these arguments, imported
# only when chosen (the self-check needs no vLLM).
AGAINST: dict[str, Callable[[argparse.Namespace], int]] = {"vllm": _against_vllm}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench fidelity``'s arguments."""
    parser.add_argument("--requests", type=positive_int, default=256, help="concurrent requests")
    parser.add_argument(
        "--prompt-tokens", type=positive_int, default=PROMPT_TOKENS_1KB, help="prompt tokens each"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens each")
    add_engine_option(parser)
    vllm = parser.add_argument_group(
        "against vLLM", "the sim against the real vLLM (--engine-option then sets vLLM's options)"
    )
    vllm.add_argument(
        "--against", choices=sorted(AGAINST), help="check the sim against this engine"
    )
    vllm.add_argument("--profiles", default="a,c", help="profiles to run, comma-separated")
    vllm.add_argument("--scale", choices=SCALES, default="smoke", help="profile scale")
    vllm.add_argument("--calibration", help="vLLM step-time profile; unset: calibrate first")
    vllm.add_argument(
        "--calibrate",
        choices=["served", "offline"],
        default="served",  # bench.fidelity_vllm.Calibrate, not imported for the self-check
        help="without --calibration: time steps through the vLLM replica, or vllm.LLM alone",
    )
    vllm.add_argument("--out", help="output directory (unset: results/fidelity-vllm-TIME)")
    vllm.add_argument(
        "--max-requests", type=positive_int, help="run only each schedule's first N requests"
    )
    vllm.add_argument(
        "--tolerance", type=float, default=0.15, help="largest relative error per cell"
    )


def run_command(args: argparse.Namespace) -> int:
    """Drive the engine and print the figures; 1 when out of tolerance (10 % step, 1 % drift).

    With ``--against ENGINE``, the end-to-end check against that real engine instead."""
    if args.against is not None:
        return AGAINST[args.against](args)
    if args.calibration is not None:
        raise UsageError("--calibration goes with --against vllm")
    try:
        config = SimConfig(**validate_engine_options("sim", dict(args.engine_options)))
    except ValueError as exc:
        raise UsageError(f"--engine-option: {exc}") from exc
    print(
        f"sim engine fidelity: {args.requests} concurrent requests, {args.prompt_tokens} prompt "
        f"tokens, {args.max_tokens} output tokens, {config.model_shape}",
        flush=True,
    )
    result = uvloop.run(drive(config, args.requests, args.prompt_tokens, args.max_tokens))
    for line in result.lines():
        print(line)
    ok = abs(result.median_step_ratio - 1) <= 0.10 and abs(result.drift) < 0.01
    print("fidelity: " + ("OK" if ok else "OUT OF TOLERANCE (10 % step, 1 % drift)"))
    return 0 if ok else 1
