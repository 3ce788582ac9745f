"""Peer load generators driving the stacks, as users check a benchmark with them (issue 17).

vLLM's own ``vllm bench serve`` is the one peer tool here: it comes with the vLLM ``nox -s vllm``
installs. The others were considered and left out: guidellm (0.8.1 downloads from this
machine's indexes, but it pins ``click~=8.4`` against vLLM's 8.5 and pulls in ``datasets`` and
``sanic``, so it needs a venv of its own); aiperf (0.13.0 downloads too, but pins psutil, pyzmq,
orjson, pillow and rich below the versions vLLM runs with: a venv of its own again); genai-perf
(a front end to NVIDIA's ``perf_analyzer`` binary, replaced by aiperf); llmperf (Ray's is not on
PyPI; the PyPI name holds an unrelated 2 kB placeholder).
"""

from __future__ import annotations

import asyncio
import gc
import urllib.request
from pathlib import Path
from typing import Any

import orjson

BENCH_PROMPTS = 12
BENCH_INPUT_LEN = 32
BENCH_OUTPUT_LEN = 8
BENCH_CONCURRENCY = 4
BENCH_TIMEOUT_S = 600.0
"""A hang guard, not a speed judgement: 12 short prompts take seconds on a quiet host, and a
minute and more through Ray Serve LLM beside the test session on a slow one."""


def listed_model(base_url: str) -> str:
    """The model the stack lists first: the name ``vllm bench serve`` sends in each request."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as reply:
        return str(orjson.loads(reply.read())["data"][0]["id"])


def vllm_bench_serve(base_url: str, model: str, tokenizer: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` in this process as its CLI does, bounded in time; its result.

    ``--model`` is given because the tool's own lookup of the served model reads a ``root``
    field that only vLLM's ``/v1/models`` has. The tool freezes the garbage collector's heap
    for its run; that is undone afterwards, so the rest of the suite collects as usual.
    """
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
         "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
         "--num-prompts", str(BENCH_PROMPTS), "--random-input-len", str(BENCH_INPUT_LEN),
         "--random-output-len", str(BENCH_OUTPUT_LEN),
         "--max-concurrency", str(BENCH_CONCURRENCY), "--seed", "0", "--disable-tqdm",
         "--save-detailed"]
    )  # fmt: skip
    try:
        return asyncio.run(asyncio.wait_for(main_async(args), BENCH_TIMEOUT_S))
    finally:
        gc.unfreeze()


def check_bench_result(result: dict[str, Any]) -> None:
    """Every prompt completed, none failed, every answer as long as asked (the tool sends
    ``ignore_eos`` and counts tokens from each stream's usage)."""
    assert result["failed"] == 0, result["errors"]
    assert result["completed"] == result["num_prompts"] == BENCH_PROMPTS
    assert result["total_output_tokens"] == BENCH_PROMPTS * BENCH_OUTPUT_LEN
