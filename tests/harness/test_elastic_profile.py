"""Profile G's TOML: its [elasticity] settings per scale, checked as strictly as profile D's
[chaos]; its scales' own session counts; and it runs only when named."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.profile import DEFAULT_PROFILES, PROFILES, SCALES, load_profile, resolve_name
from tests.support.paths import ROOT


def test_elasticity_settings_live_in_profile_g_per_scale() -> None:
    smoke, laptop = (load_profile("g", s) for s in ("smoke", "laptop"))
    assert smoke.elasticity is not None and laptop.elasticity is not None
    assert smoke.elasticity.hold_s < laptop.elasticity.hold_s
    assert isinstance(smoke.elasticity.deadline_ms, int)
    assert all(load_profile("g", s).elasticity is not None for s in SCALES)
    assert load_profile("a", "smoke").elasticity is None and smoke.fault is None
    assert smoke.classes == load_profile("a", "smoke").classes  # profile A's requests
    assert (smoke.sessions, load_profile("g", "seed").sessions) == (16, 20_000)
    assert load_profile("a", "smoke").sessions == 256  # a scale's count is its own


def test_g_runs_only_when_named() -> None:
    assert resolve_name("g") == "g_elasticity" == PROFILES[-1]
    assert "g_elasticity" not in DEFAULT_PROFILES
    assert set(DEFAULT_PROFILES) == set(PROFILES) - {"g_elasticity"}


def test_bad_elasticity_settings_are_refused(tmp_path: Path) -> None:
    base = (ROOT / "harness/profiles/g_elasticity.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(base.replace("band_pct = 25.0", "band_pc = 25.0"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("sli_target = 0.9\n", "sli_target = 1.5\n"))
    with pytest.raises(ValueError, match="sli_target"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("hold_s = 5.0\n", ""))
    with pytest.raises(ValueError, match=r"missing keys \['hold_s'\]"):
        load_profile(bad, "smoke")
    bad.write_text(base.replace("leave_grace_s = 0.5", "leave_grace_s = -1"))
    with pytest.raises(ValueError, match="leave_grace_s must be a positive number"):
        load_profile(bad, "smoke")
