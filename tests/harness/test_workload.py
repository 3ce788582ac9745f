"""Profiles, seeded schedules, prompts and the capacity preflight."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from harness.metrics import override_slos, parse_slo_option
from harness.profile import PROFILES, SCALES, load_profile, resolve_name
from harness.workload import arrival_offsets, build_schedule, check_prompt, make_prompt
from serving.wire.tokens import count_prompt_tokens
from tests.support.paths import ROOT


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("scale", SCALES)
def test_every_profile_loads_at_every_scale(name: str, scale: str) -> None:
    p = load_profile(name, scale)
    assert p.scale == scale and p.rate > 0 and p.duration_s > 0 and p.classes
    assert p.max_requests >= 1


def test_scales_grow_and_d_extends_a() -> None:
    smoke, laptop, seed = (load_profile("a", s) for s in SCALES)
    assert smoke.rate * smoke.duration_s < laptop.rate * laptop.duration_s
    assert laptop.rate * laptop.duration_s < seed.rate * seed.duration_s
    d = load_profile("D", "laptop")
    assert d.classes == laptop.classes and d.rate == laptop.rate
    assert d.fault is not None and d.fault.kind == "kill_orchestrator_replica"
    assert load_profile("c", "seed").classes[2].prompt_bytes == 32000  # prompt_tokens * 4
    assert resolve_name("b") == "b_high_concurrency"


def test_bad_profiles_are_refused(tmp_path: Path) -> None:
    base = (ROOT / "harness/profiles/a_latency.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(base.replace("max_tokens = 128", "max_tokens = 128\nmax_tokns = 3"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace('process = "constant"', 'process = "bursty"'))
    with pytest.raises(ValueError, match="arrival process"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("rate = 8.0", "rate = -1.0"))
    with pytest.raises(ValueError, match="positive"):
        load_profile(bad, "smoke")
    with pytest.raises(ValueError):
        load_profile("a", "huge")


def test_profiles_carry_their_slos_and_a_scale_may_override_them(tmp_path: Path) -> None:
    a = load_profile("a", "laptop")
    assert {s.name: s.bound_ms for s in a.slos} == {"ttft_p99_ms": 500, "e2el_p99_ms": 2000}
    base = (ROOT / "harness/profiles/a_latency.toml").read_text()
    custom = tmp_path / "custom.toml"
    custom.write_text(base + "\n[scales.smoke.slo]\nttft_p90_ms = 100\n")
    assert [str(s) for s in load_profile(custom, "smoke").slos] == ["TTFT p90 <= 100 ms"]
    assert load_profile(custom, "laptop").slos == a.slos
    custom.write_text(base.replace("ttft_p99_ms = 500", "ttft_p99_ms = 500\nttft_p90_ms = 200"))
    with pytest.raises(ValueError, match="one SLO per series"):
        load_profile(custom, "smoke")
    custom.write_text(base.replace("ttft_p99_ms = 500", "queue_p99_ms = 500"))
    with pytest.raises(ValueError, match="SLO series"):
        load_profile(custom, "smoke")
    custom.write_text(base.replace("ttft_p99_ms = 500", "ttft_p99_ms = -5"))
    with pytest.raises(ValueError, match="positive"):
        load_profile(custom, "smoke")


def test_the_command_line_slo_replaces_the_profiles_for_its_series() -> None:
    a = load_profile("a", "laptop")
    over = override_slos(a.slos, [parse_slo_option("ttft:250"), parse_slo_option("tpot_p90:40")])
    assert [str(s) for s in over] == [
        "TTFT p99 <= 250 ms",
        "TPOT p90 <= 40 ms",
        "E2EL p99 <= 2000 ms",
    ]


def test_a_sweep_point_keeps_the_seeded_shape_at_another_rate() -> None:
    a = load_profile("a", "laptop")
    point = a.at_rate(5.0, seed=7)
    assert (point.rate, point.duration_s, point.seed) == (5.0, a.sweep_duration_s, 7)
    assert point.max_requests == math.ceil(5.0 * a.sweep_duration_s)
    assert point.classes == a.classes and point.slos == a.slos
    assert len(build_schedule(point)) == point.max_requests
    with pytest.raises(ValueError, match="positive"):
        a.at_rate(0.0)


def test_offsets_constant_poisson_gamma() -> None:
    const = arrival_offsets("constant", 10.0, 5, seed=1)
    assert const.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    a = arrival_offsets("poisson", 100.0, 20_000, seed=7)
    assert np.array_equal(a, arrival_offsets("poisson", 100.0, 20_000, seed=7))
    assert not np.array_equal(a, arrival_offsets("poisson", 100.0, 20_000, seed=8))
    assert np.all(np.diff(a) >= 0) and a[0] == 0.0
    assert 20_000 / a[-1] == pytest.approx(100.0, rel=0.03)
    poisson_cv = np.diff(a).std() / np.diff(a).mean()
    bursty = np.diff(arrival_offsets("gamma", 100.0, 20_000, seed=7, burstiness=0.25))
    assert poisson_cv == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(k)


def test_schedule_is_seeded_and_mixes_classes() -> None:
    p = replace(load_profile("c", "laptop"), rate=12.0, duration_s=200.0, max_requests=10**6)
    one, two = build_schedule(p), build_schedule(p)
    assert len(one) == len(two) > 2000
    assert [r.request_class for r in one] == [r.request_class for r in two]
    assert [r.session for r in one][:50] == [r.session for r in two][:50]
    assert one[5] == two[5]
    share = Counter(r.request_class for r in one)
    assert share["small"] / len(one) == pytest.approx(0.3, abs=0.03)
    assert share["medium"] / len(one) == pytest.approx(0.5, abs=0.03)
    assert share["large"] / len(one) == pytest.approx(0.2, abs=0.03)
    other = build_schedule(replace(p, seed=1))
    assert [r.request_class for r in other][:200] != [r.request_class for r in one][:200]
    assert all(r.offset_s < p.duration_s for r in one)


def test_prompts_have_exact_bytes_and_tokens() -> None:
    for size in (1, 7, 1000, 4000, 512_000):
        text = make_prompt("a0000012", size)
        assert len(text.encode()) == size
    assert make_prompt("x1", 1000) != make_prompt("x2", 1000)
    sched = build_schedule(load_profile("c", "smoke"))
    assert all(check_prompt(r) for r in sched)
    body = sched[0].body()
    assert body["stream"] is True and body["max_tokens"] == sched[0].max_tokens
    assert count_prompt_tokens(str(body["prompt"])) == sched[0].prompt_tokens


def test_chaos_settings_live_in_profile_d_per_scale() -> None:
    smoke, laptop = (load_profile("d", s).chaos for s in ("smoke", "laptop"))
    assert smoke is not None and laptop is not None
    assert smoke.recover_timeout_s < laptop.recover_timeout_s and smoke.kv_fill == laptop.kv_fill
    assert all(load_profile("d", s).chaos is not None for s in SCALES)
    assert load_profile("a", "smoke").chaos is None


def test_bad_chaos_settings_are_refused(tmp_path: Path) -> None:
    base = (ROOT / "harness/profiles/d_fault.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(base.replace("kv_fill = 1.25", "kv_fil = 1.25"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("sli_target = 0.9\n", "sli_target = 1.5\n"))
    with pytest.raises(ValueError, match="sli_target"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("kv_requests = 24\n", ""))
    with pytest.raises(ValueError, match="missing keys"):
        load_profile(bad, "smoke")


def test_a_schedule_slices_like_a_sequence() -> None:
    schedule = build_schedule(load_profile("a_latency", "smoke"))
    assert [r.request_id for r in schedule[1:4]] == [schedule[i].request_id for i in (1, 2, 3)]
    assert schedule[-1] == schedule[len(schedule) - 1]
    with pytest.raises(IndexError):
        schedule[len(schedule)]
