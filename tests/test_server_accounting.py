"""Per-request accounting: the ring buffer, its JSONL file, and totals that match the clients'."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from server_client import H2Client, run, wait_all

from zerolayer.accounting import Accounting, read_jsonl
from zerolayer.engine import SimConfig, SimEngine
from zerolayer.server import start_replica
from zerolayer.wire.tokens import count_prompt_tokens


def test_ring_flushes_to_jsonl_and_counts_drops(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    acc = Accounting(path, capacity=3, replica="r")
    for i in range(5):
        acc.record(f"id{i}", "t", "s", 10, i, 1, 2, "completed")
    assert acc.dropped == 2  # the ring kept the newest three
    assert acc.flush() == 3
    acc.record("id5", "u", "s", 1, 1, 3, 4, "error", "kv_exhausted")
    acc.close()
    rows = read_jsonl(path)
    assert [r["request_id"] for r in rows] == ["id2", "id3", "id4", "id5"]
    assert rows[-1]["error"] == "kv_exhausted" and rows[-1]["replica"] == "r"
    assert acc.totals["t"].requests == 5 and acc.totals["t"].completion_tokens == 10
    assert acc.dropped == 2


def test_in_memory_accounting_keeps_rows() -> None:
    acc = Accounting(None, capacity=10)
    acc.record("x", "t", "s", 3, 4, 5, 6, "completed")
    assert acc.flush() == 0
    assert next(acc.rows())["completion_tokens"] == 4


def tokens_received(text: str) -> int:
    """Every token of the fixed vocabulary is one word with a leading space."""
    return text.count(" ")


@run
async def test_totals_match_what_clients_received(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    engine = SimEngine(SimConfig(model_shape="llama-3.2-1b"))
    replica = await start_replica(
        engine, name="acct", accounting_path=path, accounting_flush_s=0.05
    )
    client = await H2Client.connect("127.0.0.1", replica.port)
    streams = []
    for i in range(60):
        tenant = f"tenant-{i % 3}"
        headers = [("zl-tenant", tenant), ("zl-session", f"s{i}")]
        if i % 10 == 9:  # refused: nothing delivered
            headers.append(("zl-priority", "bogus"))
        if i % 10 == 8:  # cut by its deadline mid-stream: what was streamed still counts
            headers.append(("zl-deadline-ms", "60"))
            max_tokens = 2000
        else:
            max_tokens = 1 + i % 7
        streams.append((tenant, f"prompt {i} " * (i % 5 + 1), client.completion(
            f"prompt {i} " * (i % 5 + 1), max_tokens=max_tokens, stream=i % 2 == 0,
            headers=headers,
        )))  # fmt: skip
    await wait_all([s for _, _, s in streams], 15)
    expected: Counter[tuple[str, str]] = Counter()
    for tenant, prompt, stream in streams:
        if stream.status != 200:
            continue
        if stream.reset_code is None and b"[DONE]" not in stream.data:
            text = stream.json()["choices"][0]["text"]
        else:
            text = stream.text()
        expected[tenant, "prompt"] += count_prompt_tokens(prompt)
        expected[tenant, "completion"] += tokens_received(text)
    await asyncio.sleep(0.15)  # periodic flush
    flushed_early = len(read_jsonl(path))
    assert flushed_early > 0
    await replica.close()
    await client.close()
    await engine.close()
    rows = read_jsonl(path)
    assert len(rows) == 60
    got: Counter[tuple[str, str]] = Counter()
    for row in rows:
        got[row["tenant"], "prompt"] += row["prompt_tokens"]
        got[row["tenant"], "completion"] += row["completion_tokens"]
        assert row["end_ns"] >= row["start_ns"] > 0
    assert +got == +expected
    outcomes = Counter((r["outcome"], r["error"]) for r in rows)
    assert outcomes[("error", "bad_request")] == 6
    assert outcomes[("error", "deadline_exceeded")] == 6
    assert outcomes[("completed", None)] == 48
