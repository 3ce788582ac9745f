"""What the loader tests share: small profiles, each replica's own count of requests served, and
profile A through all three loaders on one stack (the routing test and the agreement benchmark)."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import replace
from pathlib import Path

from harness.loaders import LOADERS, LoadResult, needs_tls
from harness.loaders.k6 import K6Loader
from harness.loaders.native import NativeLoader
from harness.profile import Profile, load_profile
from harness.stacks import Stack, StackName, StackSpec, client_tls, stand_up
from harness.workload import build_schedule

_REQUESTS = re.compile(r'^zl_requests_total\{outcome="[^"]+"\} (\d+)', re.MULTILINE)


HANG_DEADLINE_MS = 300_000
"""A request deadline only a hang reaches, for a test whose claim is where requests go or how
they are labelled, not their pace: under load, 34 of k6's 175 requests over TLS passed profile
A's 30 s (tests-under-load, a load average of 29 on 2 cores)."""


def profile_at(
    rate: float,
    duration_s: float,
    max_tokens: int,
    prompt_bytes: int = 1000,
    process: str = "constant",
    deadline_ms: int | None = None,
) -> Profile:
    """Profile A's shape at another rate, length, answer size, prompt size, arrival process or
    request deadline (the profile's own unless given)."""
    p = load_profile("a", "smoke")
    classes = tuple(
        replace(c, max_tokens=max_tokens, prompt_bytes=prompt_bytes,
                deadline_ms=c.deadline_ms if deadline_ms is None else deadline_ms)
        for c in p.classes
    )  # fmt: skip
    return replace(
        p, rate=rate, duration_s=duration_s, max_requests=10**6, classes=classes, process=process
    )


def served(stack: Stack) -> dict[str, int]:
    """Requests each replica of a zero-layer stack counted (``zl_requests_total``, all outcomes)."""
    tls = client_tls(stack.tls_ca, ("http/1.1",))
    out = {}
    for url in stack.urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=tls) as resp:
            text = resp.read().decode()
        out[url] = sum(int(n) for n in _REQUESTS.findall(text))
    return out


def assert_spread(counts: dict[str, int], replicas: int, floor: float = 0.3) -> None:
    """Every replica took at least ``floor`` of the requests."""
    total = sum(counts.values())
    assert len(counts) == replicas and total > 0, counts
    assert all(n >= floor * total for n in counts.values()), counts


def three_loaders_on_profile_a(workdir: Path) -> tuple[int, dict[str, LoadResult]]:
    """Profile A at smoke scale through native, k6 and locust, one after another, against the
    same two zero-layer sim replicas (TLS where a loader needs it): the schedule's length and
    each loader's result."""
    profile = load_profile("a", "smoke")
    sched = build_schedule(profile)
    loaders = {
        "native": NativeLoader(progress=None, client_options={"health_interval_s": 0}),
        # A VU per iteration: on a loaded host k6 drops an iteration when every VU is busy.
        "k6": K6Loader(vus=len(sched)),
        "locust": LOADERS["locust"],
    }
    tls = any(needs_tls(name, StackName.ZEROLAYER) for name in loaders)
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", replicas=2, tls=tls)
    with stand_up(spec, workdir / "stack") as stack:
        return len(sched), {
            name: loader.run(sched, stack, profile, workdir / f"{name}.jsonl", workdir / name)
            for name, loader in loaders.items()
        }
