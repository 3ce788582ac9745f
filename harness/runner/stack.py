"""A stack for the length of a run's use of it: stood up from the run's spec, recorded in
run.json, warmed, watched by telemetry, and torn down however the block ends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from harness.runner.config import RunConfig
from harness.runner.console import say
from harness.runner.results import RunDir
from harness.runner.sampling import Telemetry
from harness.stacks import Stack, StackName, stand_up

WARM_TIMEOUT_S = 120.0


async def _warm_requests(stack: Stack, count: int) -> list[bool]:
    async with stack.open_client() as client:
        done = await asyncio.gather(
            *(
                client.complete(prompt=f"warm-up {i}", max_tokens=2, session=f"warm-{i}")
                for i in range(count)
            ),
            return_exceptions=True,
        )
    return [not isinstance(d, BaseException) and d.timing.status == 200 for d in done]


def warm(stack: Stack) -> None:
    """A few short requests before any profile (two per engine replica, spread by session), so
    that no stack's lazy start-up (first connections, an engine's first steps) is measured as
    its latency. Bounded; a stack that cannot answer them is reported, and the run goes on."""
    started = time.monotonic()
    count = 2 * stack.spec.replicas
    try:
        ok = asyncio.run(asyncio.wait_for(_warm_requests(stack, count), WARM_TIMEOUT_S))
    except TimeoutError:
        say(f"{stack.name}: warm-up requests unanswered after {WARM_TIMEOUT_S:g} s")
        return
    failed = f", {ok.count(False)} failed" if not all(ok) else ""
    took = time.monotonic() - started
    say(f"{stack.name}: warmed up with {count} requests in {took:.1f} s{failed}")


@contextlib.contextmanager
def stack_session(
    name: StackName, config: RunConfig, run: RunDir, tele: Telemetry
) -> Iterator[Stack]:
    """Stack ``name`` as the run's spec has it, in ``stack-<name>/`` of the results; warmed
    when this run started it (an external stack is driven as it is)."""
    spec = config.spec(name, run.credentials)
    layout = f"; {spec.cpu_layout.text()}" if spec.cpu_layout else ""
    say(f"standing up {name} ({config.engine} engine, {config.replicas} replicas{layout})")
    with stand_up(spec, run.path / f"stack-{name}") as stack:
        run.meta.stacks[name.value] = {**stack.metadata, "urls": stack.urls}
        run.save()
        if not stack.external:
            warm(stack)
        tele.watch(stack)
        try:
            yield stack
        finally:
            say(f"tearing down {name}")
            tele.unwatch(stack)
