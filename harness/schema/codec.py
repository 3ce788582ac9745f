"""The one serialiser of results records: dataclasses to JSON data and back, by their types.

pydantic (v2) rather than msgspec or cattrs: it is already installed (ray depends on it; the
others would be new dependencies), it validates the plain dataclasses the suite uses without
turning them into classes of its own (so a ``RequestRecord`` built per request in the loader's
event loop costs no validation), its Rust core validates a parsed per-request JSONL file as
one typed list as fast as building the records by hand did, and a record can state how its
layout on disk differs from its fields (``SummaryRow``'s flat vLLM keys) in one place. msgspec
decodes faster still but would be a new dependency for a step that is not the bottleneck;
cattrs would be new too, and converts in Python. Lax mode: a JSON ``3`` reads as ``3.0`` for a
float field, but a string where a number belongs, or a missing required field, is an error
naming the field. JSONL lines are written by orjson (see ``files.JsonlWriter``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter

T = TypeVar("T")


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    """One adapter per type, built on first use (building one compiles its validator)."""
    adapter = _ADAPTERS.get(kind)
    if adapter is None:
        adapter = _ADAPTERS[kind] = TypeAdapter(kind)
    return adapter


def to_data(obj: Any) -> Any:
    """A record (or a list or dict of records) as JSON data: dicts, lists, strings, numbers.
    A value of no JSON type inside a free-form field (a path in a stack's metadata) is written
    as its ``str``."""
    return _adapter(type(obj)).dump_python(obj, mode="json", by_alias=True, fallback=str)


def from_data(kind: type[T], data: Any) -> T:
    """JSON data read back as ``kind``; pydantic's ValidationError (a ValueError) when it does
    not fit. ``kind`` may be a generic alias such as ``list[RequestRecord]``."""
    result: T = _adapter(kind).validate_python(data)
    return result
