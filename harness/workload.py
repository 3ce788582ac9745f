"""Seeded workloads: the arrival schedule and request contents, fixed before a run starts.

The same (profile, scale, seed) gives the same schedule, classes, sessions and prompts on every
stack and every loader, so two stacks are compared on identical load. Arrival offsets follow
vLLM's ``bench serve``: constant spacing, Poisson, or gamma with a burstiness factor (shape =
burstiness, mean gap = 1/rate; burstiness 1 is Poisson, below 1 burstier).
Prompts are made lazily from one cached text per class, so a seed-scale schedule of millions of
512 KB requests costs a few numbers per request, not the bodies.

Beside the synthetic source (``Schedule``), a profile's ``[workload]`` may replay a ShareGPT-format
file (``ShareGPTSchedule``), a request trace (``TraceSchedule``) or generate multi-turn sessions
over shared prefixes (``SessionSchedule``); all are open loop (a request is sent at its offset
whatever happened to the ones before) and build each request's prompt only when it is asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from harness.datasets import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRow,
    WorkloadStats,
    clamp_output,
    read_sharegpt,
    read_trace,
    turn_prompt,
)
from harness.metrics import length_stats
from harness.profile import Profile, RequestClass, WorkloadSource, workload_path
from serving.engine.streams import detokenize, token_ids
from serving.engine.tokenrules import BYTES_RULE, TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN, count_prompt_tokens


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
    schedule's token rule in ``tokens`` (``serving.engine.tokenrules``). ``turn`` is its place in
    its session (1, 2, ...), 0 where the workload has no turns.
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


class _LazySchedule(Sequence[PlannedRequest]):
    """A schedule that keeps arrays and builds each request when it is asked for."""

    offsets: np.ndarray
    rule: TokenRule

    def __init__(self, profile: Profile, run_tag: str) -> None:
        self.profile = profile
        self.run_tag = run_tag
        self._shared: dict[tuple[int, int], str] = {}

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> PlannedRequest: ...

    @overload
    def __getitem__(self, i: slice) -> list[PlannedRequest]: ...

    def __getitem__(self, i: int | slice) -> PlannedRequest | list[PlannedRequest]:
        if isinstance(i, slice):
            return [self._planned(k) for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._planned(i % len(self))

    def _planned(self, i: int) -> PlannedRequest:
        raise NotImplementedError

    def __iter__(self) -> Iterator[PlannedRequest]:
        for i in range(len(self)):
            yield self._planned(i)

    def shared_text(self, rule: TokenRule, tokens: int, seed: int) -> str:
        """A text many requests share (a prefix, a trace block), made once per schedule."""
        key = (tokens, seed)
        if key not in self._shared:
            self._shared[key] = rule.text(tokens, seed)
        return self._shared[key]

    def text_request(
        self,
        i: int,
        cls: RequestClass,
        text: str,
        *,
        max_tokens: int,
        seed: int,
        session: str,
        tenant: str,
        turn: int = 0,
    ) -> PlannedRequest:
        """Request ``i`` of class ``cls`` that carries its own prompt ``text``, sized in bytes
        and under the schedule's token rule."""
        return PlannedRequest(
            index=i,
            request_id=self.request_id(i),
            offset_s=float(self.offsets[i]),
            request_class=cls.name,
            prompt_bytes=len(text.encode()),
            max_tokens=max_tokens,
            seed=seed,
            session=session,
            tenant=tenant,
            priority=cls.priority,
            deadline_ms=cls.deadline_ms,
            turn=turn,
            text=text,
            tokens=self.rule.count(text),
        )

    def request_id(self, i: int) -> str:
        tag = f"{self.run_tag}-" if self.run_tag else ""
        return f"{tag}{self.profile.name[0]}{i:07d}"

    def offered_rate(self) -> float:
        """Requests per second the schedule really offers (its count over its span)."""
        span = self.profile.duration_s
        return len(self) / span if span > 0 else 0.0


class Schedule(_LazySchedule):
    """The synthetic workload: the classes' sizes, independent prompts, sessions drawn at random
    (they only steer the ring). Under a tokenizer's rule each request announces what the rule
    counts in its prompt (``harness.promptfit.fit_classes`` sized the classes' bytes for it)."""

    def __init__(self, profile: Profile, run_tag: str = "", rule: TokenRule = BYTES_RULE) -> None:
        super().__init__(profile, run_tag)
        self.rule = rule
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

    def _planned(self, i: int) -> PlannedRequest:
        cls: RequestClass = self.profile.classes[int(self.class_index[i])]
        request = PlannedRequest(
            index=i,
            request_id=self.request_id(i),
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
        if self.rule is BYTES_RULE:
            return request
        return dataclasses.replace(request, tokens=self.rule.count(request.prompt()))


def _session_turns(
    starts: np.ndarray, turns: np.ndarray, think_s: float, rng: np.random.Generator, limit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every kept (offset, session, turn) in send order, and each session's turn offsets.

    Session ``s`` sends ``turns[s]`` turns, each an exponential think time (mean ``think_s``)
    after the one before. Turns are sorted by offset (then session, then turn), so cutting at
    ``limit`` only ever drops a session's later turns, never one inside it."""
    width = int(turns.max()) if len(turns) else 0
    gaps = rng.exponential(think_s, size=(len(starts), width)) if think_s > 0 else None
    if gaps is None:
        gaps = np.zeros((len(starts), width))
    gaps[:, 0] = 0.0
    at = starts[:, None] + np.cumsum(gaps, axis=1)
    session = np.repeat(np.arange(len(starts)), width)
    turn = np.tile(np.arange(1, width + 1), len(starts))
    keep = turn <= np.repeat(turns, width)
    offset, session, turn = at.ravel()[keep], session[keep], turn[keep]
    order = np.lexsort((turn, session, offset))[:limit]
    return offset[order], session[order], turn[order], at


class SessionSchedule(_LazySchedule):
    """Generated multi-turn sessions (``[workload] source = "sessions"``).

    Sessions start by the profile's arrival process at ``rate / max_turns`` per second (so about
    ``rate`` requests a second); session ``s`` belongs to tenant ``s mod tenants`` and prefix
    group ``s mod prefix_groups`` (the tenant's when ``prefix_groups`` is 0). Turn ``k``'s
    prompt is the group's shared prefix, then each earlier turn's user message and reply, then
    turn ``k``'s message, joined by concatenation only, so every turn's prompt starts with the
    previous one's bytes (the prefix cache hashes blocks of those bytes). The reply placed in the
    history is exactly what the sim engine answers for that turn's seed and ``max_tokens``; for
    another engine it stands in for the real reply, which the open-loop schedule cannot wait
    for: turn ``k + 1`` is sent a think time after turn ``k`` was sent, whether or not it ended.
    Each session draws one of the profile's classes by weight (its ``max_tokens``, priority and
    deadline; its ``prompt_tokens`` sizes the messages when ``message_tokens`` is 0). Turns past
    ``duration_s`` or ``max_requests`` are dropped: only ever a session's last turns.
    """

    def __init__(self, profile: Profile, run_tag: str = "", rule: TokenRule = BYTES_RULE) -> None:
        super().__init__(profile, run_tag)
        self.rule = rule
        spec = profile.workload
        count = min(profile.max_requests, int(np.ceil(profile.rate * profile.duration_s)))
        starts = arrival_offsets(
            profile.process,
            profile.rate / spec.max_turns,
            int(np.ceil(count / spec.max_turns)),
            profile.seed,
            profile.burstiness,
        )
        starts = starts[starts < profile.duration_s]
        rng = np.random.default_rng([profile.seed, 2])
        turns = np.full(len(starts), spec.max_turns)
        self.offsets, self.session_of, self.turn_of, _ = _session_turns(
            starts, turns, spec.think_s, rng, profile.max_requests
        )
        keep = self.offsets < profile.duration_s
        self.offsets, self.session_of, self.turn_of = (
            self.offsets[keep],
            self.session_of[keep],
            self.turn_of[keep],
        )
        weights = np.array([c.weight for c in profile.classes], dtype=float)
        self.class_index = rng.choice(
            len(profile.classes), size=len(starts), p=weights / weights.sum()
        )
        self.turn_seeds = rng.integers(0, 2**31 - 1, size=(len(starts), spec.max_turns))
        self.message_seeds = rng.integers(0, 2**31 - 1, size=(len(starts), spec.max_turns))
        self.groups = spec.prefix_groups or len(profile.tenants)

    def prefix(self, group: int) -> str:
        """The shared prefix (system prompt, tool definitions) of one prefix group."""
        tokens = self.profile.workload.prefix_tokens
        return (
            self.shared_text(self.rule, tokens, _mix(self.profile.seed, 3, group)) if tokens else ""
        )

    def _message(self, s: int, turn: int, cls: RequestClass) -> str:
        tokens = self.profile.workload.message_tokens or cls.prompt_tokens
        return self.rule.text(tokens, int(self.message_seeds[s, turn - 1]))

    def _planned(self, i: int) -> PlannedRequest:
        s, k = int(self.session_of[i]), int(self.turn_of[i])
        cls = self.profile.classes[int(self.class_index[s])]
        parts = [self.prefix(s % self.groups)]
        for j in range(1, k):
            parts.append(self._message(s, j, cls))
            parts.append(sim_reply(int(self.turn_seeds[s, j - 1]), cls.max_tokens))
        parts.append(self._message(s, k, cls))
        return self.text_request(
            i,
            cls,
            "".join(parts),
            max_tokens=cls.max_tokens,
            seed=int(self.turn_seeds[s, k - 1]),
            session=f"s{s}",
            tenant=self.profile.tenants[s % len(self.profile.tenants)],
            turn=k,
        )


class ShareGPTSchedule(_LazySchedule):
    """Conversations of a ShareGPT-format file replayed as sessions, in an order shuffled by the
    seed: each conversation's first ``max_turns`` turns (``harness.datasets.turn_prompt`` builds
    each turn's prompt from the history), ``max_tokens`` the length of the file's reply to it.
    Sessions start by the profile's arrival process at ``rate`` over the mean turns a session
    replays, and turns follow each other by think time as in ``SessionSchedule``. The file is not
    cycled: a run that needs more conversations than it holds ends early."""

    def __init__(self, profile: Profile, run_tag: str = "", rule: TokenRule = BYTES_RULE) -> None:
        super().__init__(profile, run_tag)
        self.rule = rule
        spec = profile.workload
        conversations = read_sharegpt(workload_path(spec.path), rule)
        order = np.random.default_rng([profile.seed, 4]).permutation(len(conversations))
        self.conversations = [conversations[int(k)] for k in order]
        turns = np.array([min(spec.max_turns, len(c.turns)) for c in self.conversations])
        rate = profile.rate / float(turns.mean())
        count = min(len(turns), profile.max_requests, int(np.ceil(rate * profile.duration_s)))
        starts = arrival_offsets(profile.process, rate, count, profile.seed, profile.burstiness)
        starts = starts[starts < profile.duration_s]
        rng = np.random.default_rng([profile.seed, 5])
        offsets, session_of, turn_of, _ = _session_turns(
            starts, turns[: len(starts)], spec.think_s, rng, profile.max_requests
        )
        keep = offsets < profile.duration_s
        self.offsets, self.session_of, self.turn_of = offsets[keep], session_of[keep], turn_of[keep]
        self.seeds = rng.integers(0, 2**31 - 1, size=len(self.offsets))

    def _planned(self, i: int) -> PlannedRequest:
        s, k = int(self.session_of[i]), int(self.turn_of[i])
        conv = self.conversations[s]
        cls = self.profile.classes[0]
        return self.text_request(
            i,
            cls,
            turn_prompt(conv.turns, k),
            max_tokens=clamp_output(self.rule.count(conv.turns[k - 1][1])),
            seed=int(self.seeds[i]),
            session=f"s{s}",
            tenant=self.profile.tenants[s % len(self.profile.tenants)],
            turn=k,
        )


class TraceSchedule(_LazySchedule):
    """A request trace replayed open loop at its own timing: offsets are the rows' times from
    the first, times ``time_scale``. A row's prompt has its ``input_length`` in tokens; where
    the row names ``hash_ids`` (512-token prefix blocks), the prompt is one seeded text block per
    id, so rows that share ids share those bytes, and the last block is cut short to the length.
    A row without a session is its own session. The trace's rows and ``duration_s`` bound the
    replay; the profile's ``rate`` and ``max_requests`` do not apply."""

    def __init__(self, profile: Profile, run_tag: str = "", rule: TokenRule = BYTES_RULE) -> None:
        super().__init__(profile, run_tag)
        self.rule = rule
        rows = read_trace(workload_path(profile.workload.path))
        stamps = np.array([r.timestamp_s for r in rows])
        offsets = (stamps - stamps[0]) * profile.workload.time_scale
        count = int(np.searchsorted(offsets, profile.duration_s))
        self.rows, self.offsets = rows[:count], offsets[:count]
        rng = np.random.default_rng([profile.seed, 6])
        self.seeds = rng.integers(0, 2**31 - 1, size=count)

    def row_text(self, row: TraceRow, seed: int) -> str:
        """``input_tokens`` of text: the row's prefix blocks, then text of its own."""
        full, rest = divmod(row.input_tokens, MOONCAKE_BLOCK_TOKENS)
        blocks = row.hash_ids[:full]
        parts = [self._block(h, MOONCAKE_BLOCK_TOKENS) for h in blocks]
        rest += (full - len(blocks)) * MOONCAKE_BLOCK_TOKENS
        if rest and len(row.hash_ids) > len(blocks) and rest < MOONCAKE_BLOCK_TOKENS:
            parts.append(self._block(row.hash_ids[len(blocks)], rest))
        elif rest:
            parts.append(self.rule.text(rest, seed))
        return "".join(parts)

    def _block(self, hash_id: int, tokens: int) -> str:
        return self.shared_text(self.rule, tokens, _mix(self.profile.seed, 7, hash_id))

    def _planned(self, i: int) -> PlannedRequest:
        row, cls = self.rows[i], self.profile.classes[0]
        seed = int(self.seeds[i])
        return self.text_request(
            i,
            cls,
            self.row_text(row, seed),
            max_tokens=clamp_output(row.output_tokens),
            seed=seed,
            session=row.session or self.request_id(i),
            tenant=self.profile.tenants[i % len(self.profile.tenants)],
        )


def _mix(*parts: int) -> int:
    """One seed from several integers (numpy's seed sequence), stable across runs."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


@functools.lru_cache(maxsize=4096)
def sim_reply(seed: int, max_tokens: int) -> str:
    """The text the sim engine answers a request with this seed and ``max_tokens``."""
    return detokenize(token_ids(seed, max_tokens))


WorkloadSchedule = Schedule | SessionSchedule | ShareGPTSchedule | TraceSchedule


def build_schedule(
    profile: Profile, run_tag: str = "", rule: TokenRule = BYTES_RULE
) -> WorkloadSchedule:
    """The seeded schedule for a profile's workload source; ``run_tag`` only prefixes request
    ids, ``rule`` counts every prompt (and makes those of the generated and trace sources)."""
    source = profile.workload.source
    if source is WorkloadSource.SESSIONS:
        return SessionSchedule(profile, run_tag, rule)
    if source is WorkloadSource.SHAREGPT:
        return ShareGPTSchedule(profile, run_tag, rule)
    if source is WorkloadSource.TRACE:
        return TraceSchedule(profile, run_tag, rule)
    return Schedule(profile, run_tag, rule)


def describe_schedule(
    schedule: Sequence[PlannedRequest], source: str, rule: TokenRule
) -> WorkloadStats:
    """The length distribution of what a schedule really sends, to set beside the file's."""
    return WorkloadStats(
        source=source,
        rule=rule.name,
        path="",
        sha256="",
        input_tokens=length_stats([r.prompt_tokens for r in schedule]),
        output_tokens=length_stats([r.max_tokens for r in schedule]),
    )


def check_prompt(req: PlannedRequest) -> bool:
    """True when the prompt text costs exactly the tokens the headers will announce."""
    return count_prompt_tokens(req.prompt()) == req.prompt_tokens
