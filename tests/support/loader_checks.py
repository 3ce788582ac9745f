"""What the loader tests share: small profiles, and each replica's own count of requests served."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import replace

from harness.profile import Profile, load_profile
from harness.stacks import Stack, client_tls

_REQUESTS = re.compile(r'^zl_requests_total\{outcome="[^"]+"\} (\d+)', re.MULTILINE)


def profile_at(
    rate: float,
    duration_s: float,
    max_tokens: int,
    prompt_bytes: int = 1000,
    process: str = "constant",
) -> Profile:
    """Profile A's shape at another rate, length, answer size, prompt size or arrival process."""
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens, prompt_bytes=prompt_bytes) for c in p.classes)
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
