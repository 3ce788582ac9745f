"""What an attack is given: the replica under attack, its time budget, a scratch folder; and the
request pieces every attack builds on (the contract's headers as ``wire.contract`` names them)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from chaos.attacks.h2raw import Header
from chaos.attacks.target import Target
from serving.wire import contract

LONG_DEADLINE: Final = (contract.DEADLINE_MS.encode(), str(contract.MAX_DEADLINE_MS).encode())
"""The longest deadline a request may ask for (an hour): what an attacker asks, so that nothing
but the replica's own limits frees what the request holds."""


@dataclass(frozen=True, slots=True)
class Setup:
    """What an attack adds to the replica's command line before it starts, the healthy
    client's API key when authentication is on, the keys the attack holds, or why it cannot
    run here."""

    args: tuple[str, ...] = ()
    healthy_api_key: str | None = None
    keys: tuple[tuple[str, str], ...] = ()
    skipped: str = ""


@dataclass(frozen=True, slots=True)
class Context:
    target: Target
    seconds: float
    workdir: Path
    setup: Setup = Setup()

    def deadline(self, at_least_s: float = 0.0) -> float:
        """The monotonic time the attack stops at: its budget, or ``at_least_s`` if longer."""
        return time.monotonic() + max(self.seconds, at_least_s)


def completion(max_tokens: int, *, stream: bool = True, model: str | None = None) -> bytes:
    """A ``/v1/completions`` body."""
    body: dict[str, object] = {"prompt": "hi", "max_tokens": max_tokens, "stream": stream}
    if model is not None:
        body["model"] = model
    return orjson.dumps(body)


def contract_header(name: str, value: str) -> Header:
    return name.encode(), value.encode()
