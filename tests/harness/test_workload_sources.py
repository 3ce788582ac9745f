"""Workload sources: ShareGPT files, traces and generated sessions, from file to schedule."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import cli
from harness.datasets import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRow,
    describe_workload,
    read_sharegpt,
    read_trace,
    turn_prompt,
)
from harness.loaders.base import new_record, write_plan
from harness.profile import (
    Profile,
    WorkloadChoice,
    WorkloadSource,
    WorkloadSpec,
    load_profile,
    parse_workload_option,
    resolve_name,
)
from harness.workload import (
    PlannedRequest,
    SessionSchedule,
    ShareGPTSchedule,
    TraceSchedule,
    build_schedule,
    describe_schedule,
    sim_reply,
)
from serving.engine.streams import detokenize, token_ids
from serving.engine.tokenrules import BYTES_RULE
from tests.support.paths import ROOT

DATA = ROOT / "harness" / "data"
SHAREGPT = DATA / "sharegpt_sample.json"
MOONCAKE = DATA / "mooncake_sample.jsonl"
BURSTGPT = DATA / "burstgpt_sample.csv"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_workload_samples", ROOT / "scripts" / "make_workload_samples.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with(profile: Profile, **workload: Any) -> Profile:
    return replace(profile, workload=replace(profile.workload, **workload))


def _roomy(profile: Profile) -> Profile:
    """The profile long and fast enough that every file row or conversation is replayed."""
    return replace(profile, rate=100.0, duration_s=10_000.0, max_requests=10**7)


def _by_session(schedule: list[PlannedRequest]) -> dict[str, list[PlannedRequest]]:
    out: dict[str, list[PlannedRequest]] = defaultdict(list)
    for r in schedule:
        out[r.session].append(r)
    return out


# Samples


def test_the_generator_reproduces_the_shipped_samples_byte_for_byte(tmp_path: Path) -> None:
    written = _generator().write_samples(tmp_path)
    assert [p.name for p in written] == [SHAREGPT.name, MOONCAKE.name, BURSTGPT.name]
    for path in written:
        assert path.read_bytes() == (DATA / path.name).read_bytes(), path.name
    assert sum(p.stat().st_size for p in written) < 400_000, "keep the samples small"


def test_the_samples_look_like_their_formats() -> None:
    conversations = read_sharegpt(SHAREGPT, BYTES_RULE)
    assert len(conversations) == 200
    assert {len(c.turns) for c in conversations} == set(range(1, 7))
    mooncake = read_trace(MOONCAKE)
    assert len(mooncake) == 300 and mooncake[-1].timestamp_s <= 60.0
    first_blocks = [r.hash_ids[0] for r in mooncake]
    assert len(set(first_blocks)) < len(first_blocks) / 10, "rows share system prompts"
    assert all(len(r.hash_ids) == -(-r.input_tokens // MOONCAKE_BLOCK_TOKENS) for r in mooncake)
    burst = read_trace(BURSTGPT)
    assert 280 <= len(burst) < 300, "failed rows (0 response tokens) are skipped"


# ShareGPT reader


def _conv(*values: str, roles: tuple[str, ...] = ()) -> dict[str, object]:
    roles = roles or tuple("human" if k % 2 == 0 else "gpt" for k in range(len(values)))
    return {"conversations": [{"from": r, "value": v} for r, v in zip(roles, values, strict=True)]}


LONG = "word " * 10  # 50 bytes: 13 tokens under bytes/4


def test_sharegpt_follows_vllms_rules(tmp_path: Path) -> None:
    entries = [
        {"id": "no-conversations"},
        _conv(LONG),  # one message: skipped
        _conv("hi", LONG),  # prompt under 4 tokens: skipped
        _conv(LONG, "ok"),  # reply under 4 tokens: skipped
        _conv("x" * 4100, LONG),  # prompt over 1024 tokens: skipped
        {"id": "kept", **_conv(LONG, LONG + "a", LONG + "b", LONG + "c", "tail")},
        _conv(LONG, LONG, LONG, LONG, roles=("gpt", "human", "gpt", "human")),
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(entries))
    convs = read_sharegpt(path, BYTES_RULE)
    assert [c.conversation_id for c in convs] == ["kept", "6"]
    assert convs[0].turns == ((LONG, LONG + "a"), (LONG + "b", LONG + "c"))
    assert len(convs[1].turns) == 1, "the first pair is taken whatever its roles; then they must"
    jsonl = tmp_path / "s.jsonl"
    jsonl.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    assert read_sharegpt(jsonl, BYTES_RULE) == convs


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[{"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]', "entry 0"),
        ('[{"conversations": "nope"}]', "must be a list"),
        ("[1, 2]", "expected an object"),
        ('{"conversations": []}\n{oops', ":2: not valid JSON"),
        ("[{]", "not valid JSON"),
        ('{"a": 1}', "no usable conversations"),
    ],
)
def test_malformed_sharegpt_files_are_clear_errors(text: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says) as exc:
        read_sharegpt(path, BYTES_RULE)
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)


def test_turn_prompts_grow_by_concatenation() -> None:
    turns = (("q1", "a1"), ("q2", "a2"), ("q3", "a3"))
    assert turn_prompt(turns, 1) == "q1"
    assert turn_prompt(turns, 3) == "q1\n\na1\n\nq2\n\na2\n\nq3"
    assert turn_prompt(turns, 3).startswith(turn_prompt(turns, 2))


# Trace readers


def test_mooncake_rows_and_their_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "session_id": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_trace(path)
    assert [r.timestamp_s for r in got] == [1.0, 2.0], "sorted by time"
    assert got[0].session == "7" and got[1].hash_ids == (1, 2)
    for bad, says in [
        ({"timestamp": 1, "output_length": 3}, "'input_length'"),
        ({"timestamp": "x", "input_length": 1, "output_length": 3}, "'timestamp'"),
        ({"timestamp": 1, "input_length": 1, "output_length": 0}, "'output_length'"),
        ({"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}, "hash_ids"),
    ]:
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=says) as exc:
            read_trace(path)
        assert f"{path}:2" in str(exc.value)


def test_burstgpt_rows_and_their_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    head = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    path.write_text(head + "5,GPT-4,100,20,120,x\n1.5,GPT-4,7,0,7,x\n2,ChatGPT,30,40,70,x\n")
    got = read_trace(path)
    assert [(r.timestamp_s, r.input_tokens, r.output_tokens) for r in got] == [
        (2.0, 30, 40),
        (5.0, 100, 20),
    ]
    path.write_text(head + "1,GPT-4,many,20,1,x\n")
    with pytest.raises(ValueError, match=rf"{path}:2 Request tokens: expected a number"):
        read_trace(path)
    path.write_text("Timestamp,Request tokens\n1,2\n")
    with pytest.raises(ValueError, match=r"missing columns \['Response tokens'\]"):
        read_trace(path)


# Generated sessions


def _sessions(**over: Any) -> Profile:
    return _with(load_profile("e", "laptop"), **over)


def _check_sessions(schedule: list[PlannedRequest], profile: Profile) -> None:
    offsets = [r.offset_s for r in schedule]
    assert offsets == sorted(offsets) and all(0 <= o < profile.duration_s for o in offsets)
    assert len(schedule) <= profile.max_requests
    for turns in _by_session(schedule).values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1)), "no gap in a session"
        assert len({r.tenant for r in turns}) == 1
        for earlier, later in itertools.pairwise(turns):
            assert later.text.startswith(earlier.text), "each turn extends the last, byte for byte"
            reply = sim_reply(earlier.seed, earlier.max_tokens)
            assert later.text[len(earlier.text) :].startswith(reply), "the sim's reply follows"
    for r in schedule:
        assert r.prompt_bytes == len(r.text.encode()) and r.tokens == BYTES_RULE.count(r.text)
        assert r.prompt() == r.text and r.prompt_tokens == r.tokens


def test_sessions_extend_their_history_and_share_a_prefix_per_group() -> None:
    profile = _sessions()
    schedule = list(build_schedule(profile))
    assert isinstance(build_schedule(profile), SessionSchedule)
    _check_sessions(schedule, profile)
    assert max(r.turn for r in schedule) == profile.workload.max_turns
    prefix_bytes = profile.workload.prefix_tokens * 4
    by_tenant = defaultdict(set)
    for r in schedule:
        by_tenant[r.tenant].add(r.text[:prefix_bytes])
    assert all(len(p) == 1 for p in by_tenant.values()), "one system prompt per tenant"
    assert len({next(iter(p)) for p in by_tenant.values()}) == len(by_tenant)


def test_the_history_holds_exactly_the_sims_reply() -> None:
    assert sim_reply(5, 3) == detokenize(token_ids(5, 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rate=st.floats(0.5, 50.0),
    duration=st.floats(0.5, 20.0),
    max_requests=st.integers(1, 200),
    turns=st.integers(1, 6),
    think=st.one_of(st.just(0.0), st.floats(0.0, 3.0)),
    prefix=st.integers(0, 300),
    groups=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_sessions_hold_their_invariants_for_any_settings(
    rate: float,
    duration: float,
    max_requests: int,
    turns: int,
    think: float,
    prefix: int,
    groups: int,
    seed: int,
) -> None:
    base = replace(
        load_profile("e", "smoke"),
        rate=rate,
        duration_s=duration,
        max_requests=max_requests,
        seed=seed,
    )
    profile = _with(
        base, max_turns=turns, think_s=think, prefix_tokens=prefix, prefix_groups=groups
    )
    schedule = list(build_schedule(profile))
    _check_sessions(schedule, profile)
    assert schedule == list(build_schedule(profile)), "the same seed gives the same schedule"


def test_sessions_start_at_rate_over_turns() -> None:
    profile = replace(_sessions(think_s=0.0), duration_s=600.0, max_requests=10**6)
    schedule = build_schedule(profile)
    assert schedule.offered_rate() == pytest.approx(profile.rate, rel=0.15)
    other = list(build_schedule(replace(profile, seed=profile.seed + 1)))
    assert other != list(schedule)


# ShareGPT and trace schedules


def test_sharegpt_replays_conversations_and_their_lengths() -> None:
    profile = _roomy(load_profile("a", "laptop").with_workload(WorkloadChoice(
        WorkloadSource.SHAREGPT, str(SHAREGPT)
    )))  # fmt: skip
    schedule = build_schedule(profile)
    assert isinstance(schedule, ShareGPTSchedule) and len(schedule) == 200
    firsts = {c.turns[0][0] for c in read_sharegpt(SHAREGPT, BYTES_RULE)}
    assert {r.text for r in schedule} == firsts, "one turn each: the first human message"
    multi = _with(profile, max_turns=6, think_s=1.0)
    requests = list(build_schedule(multi))
    _check_history(requests)
    for stats in (profile, multi):
        file_stats = describe_workload(stats, BYTES_RULE)
        assert file_stats is not None and file_stats.sha256 and file_stats.rule == "bytes/4"
        replayed = describe_schedule(build_schedule(stats), "sharegpt", BYTES_RULE)
        assert replayed.input_tokens == file_stats.input_tokens
        assert replayed.output_tokens == file_stats.output_tokens


def _check_history(requests: list[PlannedRequest]) -> None:
    offsets = [r.offset_s for r in requests]
    assert offsets == sorted(offsets)
    for turns in _by_session(requests).values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for a, b in itertools.pairwise(turns):
            assert b.text.startswith(a.text)


@pytest.mark.parametrize("path", [MOONCAKE, BURSTGPT])
def test_traces_replay_at_their_own_timing_with_their_lengths(path: Path) -> None:
    choice = WorkloadChoice(WorkloadSource.TRACE, str(path))
    profile = _roomy(load_profile("a", "laptop").with_workload(choice))
    schedule = build_schedule(profile)
    assert isinstance(schedule, TraceSchedule)
    rows = read_trace(path)
    assert [r.offset_s for r in schedule] == pytest.approx(
        [r.timestamp_s - rows[0].timestamp_s for r in rows]
    )
    assert [(r.prompt_tokens, r.max_tokens) for r in schedule] == [
        (r.input_tokens, r.output_tokens) for r in rows
    ]
    assert all(len(r.prompt()) == 4 * r.prompt_tokens for r in schedule)
    file_stats = describe_workload(profile, BYTES_RULE)
    replayed = describe_schedule(schedule, "trace", BYTES_RULE)
    assert file_stats is not None and replayed.input_tokens == file_stats.input_tokens
    assert replayed.output_tokens == file_stats.output_tokens
    faster = build_schedule(_with(profile, time_scale=0.5))
    assert faster[len(faster) - 1].offset_s == pytest.approx(schedule[-1].offset_s / 2)
    short = build_schedule(replace(profile, duration_s=10.0, max_requests=5))
    assert short[:] == schedule[: len(short)], "cut at the duration, never at max_requests"
    assert 5 < len(short) < len(schedule) and all(r.offset_s < 10.0 for r in short)


def test_trace_rows_that_share_blocks_share_prompt_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 700, "output_length": 4, "hash_ids": [1, 9]},
        {"timestamp": 9, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    profile = _roomy(load_profile("a", "laptop").with_workload(
        WorkloadChoice(WorkloadSource.TRACE, str(path))
    ))  # fmt: skip
    a, b, c = build_schedule(profile)
    block = MOONCAKE_BLOCK_TOKENS * 4
    assert a.text[:block] == b.text[:block] == c.text[:block]
    assert a.text[block : 2 * block] == c.text[block:], "block 2 is the same text in a and c"
    assert b.text[block:] != a.text[block : len(b.text)]
    assert [r.prompt_tokens for r in (a, b, c)] == [1100, 700, 1024]


# Profiles and the command line


def test_workload_tables_are_strict(tmp_path: Path) -> None:
    base = (ROOT / "harness/profiles/a_latency.toml").read_text()
    custom = tmp_path / "w.toml"
    custom.write_text(base + '\n[workload]\nsource = "sessions"\nmax_turns = 3\n')
    assert load_profile(custom, "smoke").workload == WorkloadSpec(
        source=WorkloadSource.SESSIONS, max_turns=3
    )
    custom.write_text(base + '\n[workload]\nsource = "sessions"\n[scales.smoke.workload]\n'
                      "max_turns = 2\n")  # fmt: skip
    assert load_profile(custom, "smoke").workload.max_turns == 2
    assert load_profile(custom, "laptop").workload.max_turns == 1
    for table, says in [
        ("turns = 3", "unknown keys"),
        ('source = "csv"', "source must be one of"),
        ("max_turns = 0", "max_turns must be an integer of at least 1"),
        ("time_scale = 0", "time_scale must be a positive number"),
        ("think_s = -1", "think_s must be a number of at least 0"),
        ('source = "trace"', "needs a path"),
        ('source = "trace"\npath = "no/such.jsonl"', "no such workload file: .*no/such.jsonl"),
    ]:
        custom.write_text(base + f"\n[workload]\n{table}\n")
        with pytest.raises(ValueError, match=says):
            load_profile(custom, "smoke")


def test_e_and_f_are_profiles() -> None:
    assert resolve_name("E") == "e_multi_turn" and resolve_name("f") == "f_shared_prefix"
    e, f = load_profile("e", "laptop"), load_profile("f", "laptop")
    assert (e.title, f.title) == ("E multi-turn", "F shared prefix")
    assert e.workload.source is f.workload.source is WorkloadSource.SESSIONS
    assert e.slos and f.slos
    assert len(build_schedule(load_profile("e", "smoke"))) <= 30


def test_the_workload_option_parses_and_overrides() -> None:
    trace = parse_workload_option(f"trace:{MOONCAKE}@0.5")
    assert trace == WorkloadChoice(WorkloadSource.TRACE, str(MOONCAKE), 0.5)
    assert parse_workload_option("sessions") == WorkloadChoice(WorkloadSource.SESSIONS)
    relative = parse_workload_option("sharegpt:harness/data/sharegpt_sample.json")
    assert Path(relative.path).resolve() == SHAREGPT.resolve()
    e = load_profile("e", "smoke").with_workload(trace)
    assert e.workload.source is WorkloadSource.TRACE and e.workload.time_scale == 0.5
    assert e.workload.max_turns == 3, "the profile's other settings are kept"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("csv", "unknown workload 'csv'"),
        ("sharegpt", "needs a file"),
        ("trace:", "needs a file"),
        ("trace:/no/such.jsonl", "no such workload file: /no/such.jsonl"),
        (f"trace:{MOONCAKE}@fast", "time scale must be a number"),
        (f"trace:{MOONCAKE}@-1", "time scale must be positive"),
        ("synthetic:x", "takes no file"),
    ],
)
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_workload_mistakes_are_one_line_and_exit_2(
    command: str, value: str, says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--workload", value, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1, err
    assert says in err
    assert not any(tmp_path.iterdir())


# Loaders


def test_plans_carry_explicit_prompts_and_turns(tmp_path: Path) -> None:
    schedule = list(build_schedule(load_profile("e", "smoke")))
    paths = write_plan(schedule, ["http://127.0.0.1:1"] * len(schedule), tmp_path, 1.0)
    plan = json.loads(paths["plan"].read_text())
    assert json.loads(paths["fillers"].read_text()) == [], "no fillers for explicit prompts"
    for entry, req in zip(plan, schedule, strict=True):
        assert entry["prompt"] == req.text and entry["turn"] == req.turn
        assert new_record(req, "zerolayer", "e_multi_turn", "native", 0).turn == req.turn


# locust_child patches the process with gevent on import, so it is read back in a child.
_LOCUST_READBACK = """
from gevent import monkey; monkey.patch_all()
import json, sys
from harness.loaders.locust_child import planned_request
plan = json.loads(open(sys.argv[1]).read())
print(json.dumps([[planned_request(p).prompt(), planned_request(p).prompt_tokens,
                   planned_request(p).turn] for p in plan]))
"""


def test_locust_rebuilds_explicit_prompts_from_the_plan(tmp_path: Path) -> None:
    schedule = list(build_schedule(load_profile("f", "smoke")))
    paths = write_plan(schedule, ["http://127.0.0.1:1"] * len(schedule), tmp_path, 1.0)
    out = subprocess.run(
        [sys.executable, "-c", _LOCUST_READBACK, str(paths["plan"])],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    assert json.loads(out.stdout) == [[r.prompt(), r.prompt_tokens, r.turn] for r in schedule]


_MOONCAKE_SCHEDULE = TraceSchedule(
    load_profile("a", "smoke").with_workload(WorkloadChoice(WorkloadSource.TRACE, str(MOONCAKE)))
)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 3000),
    other=st.integers(1, 3000),
    ids=st.lists(st.integers(0, 5), max_size=7),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_trace_prompt_has_its_length_and_shares_its_blocks(
    tokens: int, other: int, ids: list[int], seed: int
) -> None:
    a = _MOONCAKE_SCHEDULE.row_text(TraceRow(0.0, tokens, 1, tuple(ids)), seed)
    b = _MOONCAKE_SCHEDULE.row_text(TraceRow(0.0, other, 1, tuple(ids)), seed + 1)
    assert BYTES_RULE.count(a) == tokens and len(a) == 4 * tokens
    shared = min(tokens, other, len(ids) * MOONCAKE_BLOCK_TOKENS) * 4
    assert a[:shared] == b[:shared], "the same block ids give the same bytes"


def test_a_trace_cannot_be_swept(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A trace keeps its own timing, so every rate of a sweep would replay the same requests:
    refused in one line before anything starts, not swept into identical points."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["sweep", "--workload", f"trace:{MOONCAKE}", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1, err
    assert "own timing" in err
    assert not any(tmp_path.iterdir())
