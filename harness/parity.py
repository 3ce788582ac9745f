"""Configuration parity: the stacks' engines must run with the same settings before any load.

A comparison of stacks over "the same engine" measures the layers only if the engines really
run alike; a default that differs (Ray Serve LLM once set ``max_num_seqs`` to 128 where ``vllm
serve`` used 1024: ray-project/ray PR 55159) would read as overhead. So each stood-up stack's
engines are asked what they run with (``Stack.engine_settings``: the sim's config as the replica
or actor runs it, vLLM's own config, Ray Serve LLM's applied engine arguments), and every
setting known on two or more stacks must have one value. A mismatch stops the run with one
error line (:class:`ParityError`, a usage error: exit 2) unless ``--allow-mismatch``, which
records it in run.json (``parity``) for the report to mark.

:func:`compare` is the pure rule; :func:`check_parity` reads the stacks given, adds them to what
the run has recorded, and judges everything recorded: ``zl-bench run`` and ``sweep`` call it once,
with every stack up and warmed, before the first trial; a loop that stood its stacks up one after
another could call it as each comes up (before that stack's load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from harness.errors import UsageError
from harness.runner.console import say
from harness.runner.results import RunDir
from harness.schema import Parity, ParityVerdict, SettingsMismatch
from harness.stacks import Stack
from serving.engine.settings import EngineSettings

SETTINGS = tuple(f.name for f in fields(EngineSettings))
# stack -> replica -> the settings its engine reported
StackSettings = Mapping[str, Mapping[str, EngineSettings]]


class ParityError(UsageError):
    """The stacks' engines run with different settings: one line naming each setting and each
    stack's value."""


def _known(per_replica: Mapping[str, EngineSettings], setting: str) -> dict[str, Any]:
    """Each replica's value of ``setting``, where its engine has it."""
    values = {name: getattr(s, setting) for name, s in per_replica.items()}
    return {name: value for name, value in values.items() if value is not None}


def compared(settings: StackSettings) -> list[str]:
    """The settings known on at least two stacks (the others have nothing to be compared with)."""
    return [
        name
        for name in SETTINGS
        if sum(bool(_known(per_replica, name)) for per_replica in settings.values()) >= 2
    ]


def _values(settings: StackSettings, setting: str) -> dict[str, Any]:
    """Each stack's value of ``setting`` (by ``stack/replica`` where its replicas disagree)."""
    values: dict[str, Any] = {}
    for stack, per_replica in settings.items():
        known = _known(per_replica, setting)
        if len(set(known.values())) == 1:
            values[stack] = next(iter(known.values()))
        else:
            values |= {f"{stack}/{replica}": value for replica, value in known.items()}
    return values


def compare(settings: StackSettings) -> list[SettingsMismatch]:
    """Every setting with more than one value among the engines that have it, in the order of
    :class:`EngineSettings`: across stacks, and between the replicas of one stack. A setting no
    engine has, or only one stack has and all its replicas agree on, is not a mismatch."""
    found = []
    for setting in SETTINGS:
        values = _values(settings, setting)
        if len(set(values.values())) > 1:
            found.append(SettingsMismatch(setting, values))
    return found


def mismatch_line(mismatches: Sequence[SettingsMismatch]) -> str:
    """The one error line: each differing setting with each stack's value, and what to do."""
    return (
        "the stacks' engines run with different settings ("
        + "; ".join(m.text() for m in mismatches)
        + "): give every stack the same engine settings, or pass --allow-mismatch to run "
        "anyway and record the difference"
    )


def _read(stack: Stack, parity: Parity) -> None:
    """Record ``stack``'s settings in ``parity`` (or, where they cannot be read, why not)."""
    try:
        parity.settings[stack.name.value] = stack.engine_settings()
    except Exception as exc:  # a stack whose engines cannot say is recorded, not fatal
        parity.unreadable[stack.name.value] = f"{type(exc).__name__}: {exc}"
        say(f"{stack.name}: engine settings could not be read ({exc}); not compared")
        return
    parity.unreadable.pop(stack.name.value, None)


def _verdict(parity: Parity) -> ParityVerdict:
    if parity.mismatches:
        return ParityVerdict.ALLOWED if parity.allow_mismatch else ParityVerdict.STOPPED
    if not parity.compared:
        return ParityVerdict.UNCHECKED
    return ParityVerdict.MATCHED


def check_parity(
    stacks: Sequence[Stack], allow_mismatch: bool, run: RunDir | None = None
) -> list[SettingsMismatch]:
    """Read each stood-up stack's engine settings and compare them with every stack's the run
    has recorded (``run``'s ``parity``, saved; without a run, only the stacks given). Returns the
    mismatches; raises :class:`ParityError` for any unless ``allow_mismatch``."""
    parity = run.meta.parity if run is not None else Parity()
    parity.allow_mismatch = allow_mismatch
    for stack in stacks:
        _read(stack, parity)
    parity.compared = compared(parity.settings)
    parity.mismatches = compare(parity.settings)
    parity.verdict = _verdict(parity)
    if run is not None:
        run.save()
    if parity.mismatches and not allow_mismatch:
        raise ParityError(mismatch_line(parity.mismatches))
    for mismatch in parity.mismatches:
        say(f"engine settings differ (--allow-mismatch: recorded) {mismatch.text()}")
    if parity.verdict is ParityVerdict.MATCHED:
        say(f"engine settings match across stacks: {', '.join(parity.compared)}")
    return list(parity.mismatches)
