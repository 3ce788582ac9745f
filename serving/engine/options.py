"""Engine options from a command line: one spelling, ``--engine-option KEY=VALUE``, everywhere.

``zl-replica``, ``zl-baseline`` and ``zl-bench`` parse with :func:`parse_engine_option` and check
with :func:`validate_engine_options`, so a misspelt or mistyped option is refused up front with
the list of valid ones, not deep inside an engine's constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from serving.engine.kinds import engine_kind


def parse_engine_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as (key, value): VALUE parsed as JSON when it is JSON, else kept as a string.

    Dashes in KEY become underscores, so ``num-kv-blocks=64`` and ``num_kv_blocks=64`` agree.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def _accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` fits the annotation ``kind`` (the few shapes config fields use)."""
    if kind is Any:
        return True
    origin = typing.get_origin(kind)
    if origin is types.UnionType or origin is typing.Union:
        return any(_accepts(arm, value) for arm in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if origin is not None:
        return isinstance(value, origin)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)


def validate_engine_options(engine: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked against the engine's config dataclass; a clean copy to build it from.

    Raises ValueError naming the bad key and listing the valid ones, or naming a value of the
    wrong type or one the config itself refuses; an unknown engine lists the engines.
    """
    config = engine_kind(engine).config_class
    if config is None:
        if options:
            raise ValueError(f"the {engine} engine takes no options, got {', '.join(options)}")
        return {}
    hints = typing.get_type_hints(config)
    valid = [f.name for f in dataclasses.fields(config)]
    clean: dict[str, Any] = {}
    for key, value in options.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ValueError(
                f"unknown {engine} engine option {key!r}; valid options: {', '.join(valid)}"
            )
        kind = hints[name]
        if not _accepts(kind, value):
            raise ValueError(
                f"{engine} engine option {name} takes {_type_name(kind)}, got {value!r}"
            )
        clean[name] = float(value) if kind is float else value
    try:
        config(**clean)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{engine} engine options: {exc}") from None
    return clean


def engine_option(text: str) -> tuple[str, Any]:
    """``--engine-option KEY=VALUE`` (VALUE as JSON, else a string); see ``parse_engine_option``."""
    try:
        return parse_engine_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    """The one spelling of engine options: ``--engine-option KEY=VALUE``, repeatable."""
    parser.add_argument(
        "--engine-option",
        dest="engine_options",
        action="append",
        type=engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="engine config field, repeatable; VALUE is parsed as JSON when it is JSON",
    )
