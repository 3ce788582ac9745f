"""Seeded workloads: the arrival schedule and request contents, fixed before a run starts.

The same (profile, scale, seed) gives the same schedule, classes, sessions and prompts on every
stack and every loader, so two stacks are compared on identical load. Arrival offsets follow
vLLM's ``bench serve``: constant spacing, Poisson, or gamma with a burstiness factor (shape =
burstiness, mean gap = 1/rate; burstiness 1 is Poisson, below 1 burstier).
Prompts are made lazily from one cached text per class, so a seed-scale schedule of millions of
512 KB requests costs a few numbers per request, not the bodies.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from harness.profile import Profile, RequestClass
from zerolayer.engine.tokens import detokenize, token_ids
from zerolayer.wire.tokens import BYTES_PER_TOKEN, count_prompt_tokens


def arrival_offsets(
    process: str, rate: float, count: int, seed: int, burstiness: float = 1.0
) -> np.ndarray:
    """``count`` send offsets in seconds from the start, non-decreasing, the first at 0."""
    if count <= 0:
        return np.zeros(0)
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if process == "constant":
        return np.arange(count, dtype=float) / rate
    rng = np.random.default_rng(seed)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=count)
    elif process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be positive, got {burstiness}")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    else:
        raise ValueError(f"unknown arrival process {process!r}")
    gaps[0] = 0.0
    return np.cumsum(gaps)


@functools.lru_cache(maxsize=64)
def filler_text(prompt_bytes: int, seed: int) -> str:
    """Prompt text of exactly ``prompt_bytes`` ASCII bytes, from the shared token vocabulary."""
    ids = token_ids(seed, prompt_bytes // 3 + 2)
    return detokenize(ids)[:prompt_bytes]


def make_prompt(request_id: str, prompt_bytes: int, seed: int = 0) -> str:
    """A prompt of exactly ``prompt_bytes`` bytes that starts with the request id (so no two are
    equal) and is otherwise text from the engines' vocabulary."""
    head = f"{request_id}:"
    if len(head) >= prompt_bytes:
        return head[:prompt_bytes]
    return head + filler_text(prompt_bytes, seed)[: prompt_bytes - len(head)]


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of the schedule: when to send it and what to send.

    A synthetic request's prompt is made from its id and ``prompt_bytes``; a request of a
    dataset, trace or session workload carries its prompt in ``text`` and its length under the
    schedule's token rule in ``tokens`` (``harness.tokens``). ``turn`` is its place in its
    session (1, 2, ...), 0 where the workload has no turns.
    """

    index: int
    request_id: str
    offset_s: float
    request_class: str
    prompt_bytes: int
    max_tokens: int
    seed: int
    session: str
    tenant: str
    priority: str
    deadline_ms: int
    turn: int = 0
    text: str = ""
    tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        if self.tokens:
            return self.tokens
        return max(1, -(-self.prompt_bytes // BYTES_PER_TOKEN))

    def prompt(self) -> str:
        """The prompt text; the schedule's token rule counts it as ``prompt_tokens``."""
        if self.text:
            return self.text
        return make_prompt(self.request_id, self.prompt_bytes)

    def body(self) -> dict[str, object]:
        """The OpenAI ``/v1/completions`` body both stacks accept."""
        return {
            "prompt": self.prompt(),
            "max_tokens": self.max_tokens,
            "stream": True,
            "seed": self.seed,
        }


class Schedule(Sequence[PlannedRequest]):
    """The whole run's requests, built from arrays so a large schedule stays small in memory."""

    def __init__(self, profile: Profile, run_tag: str = "") -> None:
        self.profile = profile
        self.run_tag = run_tag
        count = min(profile.max_requests, int(np.ceil(profile.rate * profile.duration_s)))
        offsets = arrival_offsets(
            profile.process, profile.rate, count, profile.seed, profile.burstiness
        )
        offsets = offsets[offsets < profile.duration_s]
        self.offsets = offsets
        n = len(offsets)
        rng = np.random.default_rng([profile.seed, 1])
        weights = np.array([c.weight for c in profile.classes], dtype=float)
        self.class_index = rng.choice(len(profile.classes), size=n, p=weights / weights.sum())
        self.sessions = rng.integers(0, profile.sessions, size=n)
        self.tenants = rng.integers(0, len(profile.tenants), size=n)
        self.seeds = rng.integers(0, 2**31 - 1, size=n)

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> PlannedRequest: ...

    @overload
    def __getitem__(self, i: slice) -> list[PlannedRequest]: ...

    def __getitem__(self, i: int | slice) -> PlannedRequest | list[PlannedRequest]:
        if isinstance(i, slice):
            return [self._planned(k) for k in range(*i.indices(len(self)))]
        return self._planned(i)

    def _planned(self, i: int) -> PlannedRequest:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        cls: RequestClass = self.profile.classes[int(self.class_index[i])]
        tag = f"{self.run_tag}-" if self.run_tag else ""
        return PlannedRequest(
            index=i,
            request_id=f"{tag}{self.profile.name[0]}{i:07d}",
            offset_s=float(self.offsets[i]),
            request_class=cls.name,
            prompt_bytes=cls.prompt_bytes,
            max_tokens=cls.max_tokens,
            seed=int(self.seeds[i]),
            session=f"s{int(self.sessions[i])}",
            tenant=self.profile.tenants[int(self.tenants[i])],
            priority=cls.priority,
            deadline_ms=cls.deadline_ms,
        )

    def __iter__(self) -> Iterator[PlannedRequest]:
        for i in range(len(self)):
            yield self[i]

    def offered_rate(self) -> float:
        """Requests per second the schedule really offers (its count over its span)."""
        span = self.profile.duration_s
        return len(self) / span if span > 0 else 0.0


def build_schedule(profile: Profile, run_tag: str = "") -> Schedule:
    """The seeded schedule for a profile; ``run_tag`` only prefixes request ids."""
    return Schedule(profile, run_tag)


def check_prompt(req: PlannedRequest) -> bool:
    """True when the prompt text costs exactly the tokens the headers will announce."""
    return count_prompt_tokens(req.prompt()) == req.prompt_tokens
