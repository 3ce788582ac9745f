"""Readers for recorded workloads: ShareGPT-format conversations and request traces.

ShareGPT files are read as ``vllm bench serve`` reads them (a JSON list, or JSONL, of
``{"id", "conversations": [{"from", "value"}, ...]}``): entries without ``conversations`` or with
fewer than two messages are skipped, and a conversation is kept when its first exchange passes
vLLM's length filter (prompt and reply at least 4 tokens, prompt at most 1024, both at most 2048).
Its turns are its leading (human, gpt) pairs; the first pair is taken whatever its roles say, as
vLLM takes it.

Traces: Mooncake-style JSONL (``timestamp`` ms, ``input_length``, ``output_length``, optional
``hash_ids``: ids of 512-token prefix blocks, optional ``session_id``) and BurstGPT-style CSV
(``Timestamp`` s, ``Request tokens``, ``Response tokens``; other columns ignored, rows with no
response tokens are failed requests and skipped). The format follows the file's suffix.

Each reader's file also has a length distribution of its own (``describe_workload``), so a report
can put the replayed requests' distribution (``harness.workload.describe_schedule``) beside
the file's.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from harness.metrics import length_stats
from harness.profile import FILE_SOURCES, WorkloadSource, workload_path
from harness.schema import LengthStats
from serving.engine.tokenrules import TokenRule
from serving.wire.contract import MAX_OUTPUT_TOKENS

if TYPE_CHECKING:
    from harness.profile import Profile

MOONCAKE_BLOCK_TOKENS: Final = 512
# vLLM's ``is_valid_sequence`` defaults, applied to a conversation's first exchange.
SHAREGPT_MIN_TOKENS: Final = 4
SHAREGPT_MAX_PROMPT_TOKENS: Final = 1024
SHAREGPT_MAX_TOTAL_TOKENS: Final = 2048
TURN_SEPARATOR: Final = "\n\n"
_BURSTGPT_COLUMNS: Final = ("Timestamp", "Request tokens", "Response tokens")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One ShareGPT conversation: its id and its (human message, model reply) turns."""

    conversation_id: str
    turns: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One traced request: arrival time, lengths, shared-prefix block ids and session."""

    timestamp_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    session: str = ""


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """The input and output lengths of a workload under one token rule, and where they came
    from (``path`` and ``sha256`` are empty for a schedule's own)."""

    source: str
    rule: str
    path: str
    sha256: str
    input_tokens: LengthStats
    output_tokens: LengthStats


def clamp_output(tokens: int) -> int:
    """An output length as a request's ``max_tokens``: at least 1, at most the contract's."""
    return min(max(1, tokens), MAX_OUTPUT_TOKENS)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ShareGPT


def _sharegpt_entries(path: Path) -> list[Any]:
    """The file's entries: a JSON list, or one JSON object a line."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of conversations")
        return data
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
    return entries


def _messages(where: str, entry: Any) -> list[tuple[str, str]] | None:
    """An entry's (role, text) messages, None where vLLM skips the entry."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
    if "conversations" not in entry:
        return None
    conv = entry["conversations"]
    if not isinstance(conv, list):
        raise ValueError(f"{where}: 'conversations' must be a list")
    out = []
    for k, msg in enumerate(conv):
        if not isinstance(msg, dict) or not isinstance(msg.get("value"), str):
            raise ValueError(f"{where}: message {k} needs a string 'value'")
        out.append((str(msg.get("from", "")), msg["value"]))
    return out if len(out) >= 2 else None


def _turns(messages: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The leading (human, gpt) pairs; the first pair whatever its roles (vLLM's rule)."""
    turns = [(messages[0][1], messages[1][1])]
    for k in range(2, len(messages) - 1, 2):
        (role_a, human), (role_b, reply) = messages[k], messages[k + 1]
        if (role_a, role_b) != ("human", "gpt"):
            break
        turns.append((human, reply))
    return tuple(turns)


def _first_turn_valid(turn: tuple[str, str], rule: TokenRule) -> bool:
    prompt, reply = rule.count(turn[0]), rule.count(turn[1])
    return (
        prompt >= SHAREGPT_MIN_TOKENS
        and reply >= SHAREGPT_MIN_TOKENS
        and prompt <= SHAREGPT_MAX_PROMPT_TOKENS
        and prompt + reply <= SHAREGPT_MAX_TOTAL_TOKENS
    )


def read_sharegpt(path: Path, rule: TokenRule) -> list[Conversation]:
    """The file's usable conversations, in file order (the schedule shuffles them)."""
    out = []
    for i, entry in enumerate(_sharegpt_entries(path)):
        messages = _messages(f"{path}: entry {i}", entry)
        if messages is None:
            continue
        turns = _turns(messages)
        if _first_turn_valid(turns[0], rule):
            out.append(Conversation(str(entry.get("id", i)), turns))
    if not out:
        raise ValueError(f"{path}: no usable conversations")
    return out


def turn_prompt(turns: Sequence[tuple[str, str]], k: int) -> str:
    """Turn ``k``'s prompt (1-based): the earlier messages and replies, then human message ``k``,
    joined by a blank line, so each turn's prompt starts with the previous turn's, byte for
    byte. Turn 1's is the first message alone, as ``vllm bench serve`` sends it."""
    parts: list[str] = []
    for human, reply in turns[: k - 1]:
        parts += [human, reply]
    parts.append(turns[k - 1][0])
    return TURN_SEPARATOR.join(parts)


# Traces


def _int_field(where: str, row: dict[str, Any], key: str, least: int) -> int:
    value = row.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {key!r} must be an integer of at least {least}, got {value!r}")
    return value


def _mooncake_row(where: str, row: Any) -> TraceRow:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    stamp = row.get("timestamp")
    if not isinstance(stamp, int | float) or isinstance(stamp, bool):
        raise ValueError(f"{where}: 'timestamp' (ms) must be a number, got {stamp!r}")
    hash_ids = row.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRow(
        timestamp_s=float(stamp) / 1000.0,
        input_tokens=_int_field(where, row, "input_length", 1),
        output_tokens=_int_field(where, row, "output_length", 1),
        hash_ids=tuple(hash_ids),
        session=str(row.get("session_id", "")),
    )


def _read_mooncake(path: Path) -> list[TraceRow]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON: {exc}") from None
        rows.append(_mooncake_row(f"{path}:{n}", raw))
    return rows


def _csv_number(where: str, text: str | None, kind: type) -> Any:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{where}: must not be negative, got {text!r}")
    return value


def _read_burstgpt(path: Path) -> list[TraceRow]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}")
        rows = []
        for n, row in enumerate(reader, 2):
            where = f"{path}:{n}"
            output = _csv_number(f"{where} Response tokens", row["Response tokens"], int)
            if output == 0:
                continue
            rows.append(
                TraceRow(
                    timestamp_s=_csv_number(f"{where} Timestamp", row["Timestamp"], float),
                    input_tokens=max(
                        1, _csv_number(f"{where} Request tokens", row["Request tokens"], int)
                    ),
                    output_tokens=output,
                )
            )
    return rows


def read_trace(path: Path) -> list[TraceRow]:
    """A trace's rows in arrival order: ``.csv`` is BurstGPT's format, anything else Mooncake's
    JSONL."""
    rows = _read_burstgpt(path) if path.suffix.lower() == ".csv" else _read_mooncake(path)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return sorted(rows, key=lambda r: r.timestamp_s)


# Distributions


def _sharegpt_lengths(
    conversations: Sequence[Conversation], max_turns: int, rule: TokenRule
) -> tuple[list[int], list[int]]:
    inputs, outputs = [], []
    for conv in conversations:
        for k in range(1, min(max_turns, len(conv.turns)) + 1):
            inputs.append(rule.count(turn_prompt(conv.turns, k)))
            outputs.append(clamp_output(rule.count(conv.turns[k - 1][1])))
    return inputs, outputs


def describe_workload(profile: Profile, rule: TokenRule) -> WorkloadStats | None:
    """The length distribution the profile's workload file defines (every turn it would replay,
    however long the run), or None for a source without a file."""
    spec = profile.workload
    if spec.source not in FILE_SOURCES:
        return None
    path = workload_path(spec.path)
    if spec.source is WorkloadSource.SHAREGPT:
        inputs, outputs = _sharegpt_lengths(read_sharegpt(path, rule), spec.max_turns, rule)
    else:
        rows = read_trace(path)
        inputs = [r.input_tokens for r in rows]
        outputs = [clamp_output(r.output_tokens) for r in rows]
    return WorkloadStats(
        source=spec.source.value,
        rule=rule.name,
        path=str(path),
        sha256=file_sha256(path),
        input_tokens=length_stats(inputs),
        output_tokens=length_stats(outputs),
    )
