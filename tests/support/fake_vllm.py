"""A test double of vLLM's AsyncLLM (the external system, which needs vLLM installed): the parts
the adapter uses (``generate`` yielding DELTA ``RequestOutput``s, ``abort``, ``shutdown``, stat
loggers called with ``SchedulerStats``). It is not one of our components."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from serving.engine.vllm_engine import VllmEngineConfig

DELTA = "DELTA"


class FakeAsyncLLMForTests:
    """A stand-in for vLLM's AsyncLLM: one token per 1 ms step, stats to the stat loggers."""

    def __init__(self, config: VllmEngineConfig, stat_loggers: list[Any]) -> None:
        self.config = config
        self.loggers = [factory(None, 0) for factory in stat_loggers]
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 1000)
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=500))
        self.params: list[Any] = []
        self.prompts: list[Any] = []
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.shut_down = False

    def _report(self) -> None:
        stats = SimpleNamespace(
            num_running_reqs=len(self.active),
            num_waiting_reqs=0,
            kv_cache_usage=len(self.active) / 10,
        )
        for logger in self.loggers:
            logger.record(
                scheduler_stats=stats, iteration_stats=SimpleNamespace(num_preempted_reqs=0)
            )

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str):
        self.prompts.append(prompt)
        self.params.append(sampling_params)
        self.active.add(request_id)
        assert sampling_params["output_kind"] == DELTA
        try:
            for i in range(sampling_params["max_tokens"]):
                await asyncio.sleep(0.001)
                if request_id not in self.active:
                    return
                self._report()
                finished = i == sampling_params["max_tokens"] - 1
                token = (sampling_params["seed"] * 31 + i) % 1000
                top = sampling_params.get("logprobs")
                yield SimpleNamespace(
                    outputs=[
                        SimpleNamespace(
                            token_ids=[token],
                            text=f" t{token}",
                            finish_reason="length" if finished else None,
                            logprobs=None if top is None else [fake_position(token, i, top)],
                        )
                    ],
                    finished=finished,
                    prompt_token_ids=prompt["prompt_token_ids"],
                )
        except asyncio.CancelledError:
            await self.abort(request_id)
            raise
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    def shutdown(self) -> None:
        self.shut_down = True


def fake_position(token: int, step: int, top: int) -> dict[int, SimpleNamespace]:
    """One position of vLLM's sample logprobs: token id -> Logprob(logprob, rank,
    decoded_token), the sampled token first. It ranks first on even steps and just outside the
    top ``top`` on odd ones; the alternatives (ids from 1001, rank 2 not decoded) are inserted
    from the last rank up, so only sorting by rank puts them in order."""
    sampled_rank = 1 if step % 2 == 0 else top + 1
    position = {
        token: SimpleNamespace(
            logprob=-0.5 * sampled_rank, rank=sampled_rank, decoded_token=f" t{token}"
        )
    }
    for rank in range(top, 0, -1):
        alternative = token if rank == sampled_rank else 1000 + rank
        decoded = None if rank == 2 else f" a{rank}"
        entry = SimpleNamespace(logprob=-0.5 * rank, rank=rank, decoded_token=decoded)
        position.setdefault(alternative, entry)
    return position
