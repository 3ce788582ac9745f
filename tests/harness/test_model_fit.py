"""What the harness plans inside a model's limits, before any tokenizer or engine: profile
classes refused per class and sessions cut (``harness.promptfit``), the calibration grid fitted
to the context (``bench.calibrate.fit_grid``), the outputs checked (``harness.outputs``), and a
part that exited at start reported by the reason its log gives (``exit_reason``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.calibrate import MIN_PREFILL_POINTS, Grid, fit_grid, fit_points
from bench.calibrate_vllm import DECODE_TOKENS
from harness.errors import UsageError
from harness.outputs import output_dir, output_file
from harness.profile import PROFILES, load_profile
from harness.promptfit import _session_tokens, fit_profiles, fit_to_context
from harness.stacks.processes import exit_reason


def test_a_class_whose_output_leaves_no_room_is_refused_and_the_rest_kept() -> None:
    profile = load_profile("c_mixed", "smoke")  # small 32, medium 128, large 64 output tokens
    fit = fit_to_context(profile, 100)
    assert fit.profile is not None
    assert [c.name for c in fit.profile.classes] == ["small", "large"]
    assert fit.lines == (
        "c_mixed class medium: refused (max_tokens 128 leaves no room for a prompt in "
        "max_model_len 100)",
    )
    assert fit_to_context(profile, 4096) == type(fit)(profile, ())


def test_no_profile_that_fits_is_one_line_naming_each_refusal() -> None:
    profiles = [load_profile(p, "smoke") for p in ("a_latency", "b_high_concurrency")]
    with pytest.raises(ValueError) as exc:
        fit_profiles(profiles, 32)
    text = str(exc.value)
    assert text.startswith("no profile fits max_model_len 32: a_latency class a: refused")
    assert "b_high_concurrency: left out" in text and "\n" not in text
    kept, lines = fit_profiles(profiles, 100)
    assert [p.name for p in kept] == ["b_high_concurrency"]
    assert lines[-1] == "a_latency: left out, none of its classes fits max_model_len 100"
    assert fit_profiles(profiles, None) == (profiles, [])


@given(st.integers(200, 20_000))
def test_sessions_keep_the_most_turns_that_fit(context: int) -> None:
    profile = load_profile("e_multi_turn", "laptop")  # 1000-token prefix, 6 turns of 100
    fit = fit_to_context(profile, context)
    room = int(context * 0.95)
    if fit.profile is None:
        assert all(_session_tokens(profile, c, 1) > room for c in profile.classes)
        return
    turns = fit.profile.workload.max_turns
    assert 1 <= turns <= profile.workload.max_turns
    for cls in fit.profile.classes:
        assert _session_tokens(profile, cls, turns) <= room
    if turns < profile.workload.max_turns:
        assert any(_session_tokens(profile, c, turns + 1) > room for c in fit.profile.classes)
        assert any("sessions: 6 turns -> " in line for line in fit.lines)


def test_every_profile_fits_the_standard_tiny_model_untouched() -> None:
    for name in PROFILES:
        profile = load_profile(name, "smoke")
        assert fit_to_context(profile, 32768).profile == profile


@given(
    st.lists(st.integers(1, 10_000), min_size=1, max_size=6, unique=True),
    st.integers(1, 10_000),
    st.integers(1, 4),
)
def test_fitted_points_lie_inside_the_limit_and_keep_those_that_did(
    points: list[int], limit: int, least: int
) -> None:
    fitted = fit_points(tuple(sorted(points)), limit, least)
    assert fitted == tuple(sorted(set(fitted)))
    assert all(1 <= p <= limit for p in fitted)
    assert {p for p in points if p <= limit} <= set(fitted)
    assert len(fitted) >= min(least, len({limit // 4**k for k in range(20)} - {0}))


def test_the_default_grid_is_fitted_to_a_short_model_and_a_given_part_is_only_checked() -> None:
    grid = Grid(contexts=(128, 1024, 3072), prefill_lengths=(128, 1024, 3072))
    fitted, lines = fit_grid(grid, 2048)
    assert fitted.contexts == (128, 1024, 2048 - DECODE_TOKENS)
    assert fitted.prefill_lengths == (128, 1024, 2047)
    assert lines == [
        f"decode contexts 128,1024,3072 -> 128,1024,{2048 - DECODE_TOKENS}, fitted to "
        "max_model_len 2048",
        "prefill lengths 128,1024,3072 -> 128,1024,2047, fitted to max_model_len 2048",
    ]
    tiny, _ = fit_grid(grid, 64)
    assert len(tiny.prefill_lengths) >= MIN_PREFILL_POINTS and max(tiny.prefill_lengths) == 63
    assert fit_grid(grid, None) == (grid, [])
    assert fit_grid(grid, 8192) == (grid, [])
    with pytest.raises(ValueError, match="lower --contexts/--prefill"):
        fit_grid(grid, 2048, frozenset({"contexts"}))
    assert fit_grid(dataclasses.replace(grid, contexts=(64,)), 2048, frozenset({"contexts"}))[
        0
    ].contexts == (64,)


def test_outputs_are_checked_before_anything_is_measured(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert output_file(tmp_path / "new" / "out.json") == tmp_path / "new" / "out.json"
    assert (tmp_path / "new").is_dir(), "the one write at a command's end must find its folder"
    with pytest.raises(UsageError, match="is a file; give a directory"):
        output_dir(a_file)
    with pytest.raises(UsageError, match="is a file, not a directory"):
        output_dir(a_file / "under")
    with pytest.raises(UsageError, match="is a directory; give a file name"):
        output_file(tmp_path)
    with pytest.raises(UsageError, match=r"--json .* is a file, not a directory"):
        output_file(a_file / "v.json", "--json")


VLLM_CORE_LOG = """\
INFO 12-02 engine core starting
(EngineCore pid=4242) Traceback (most recent call last):
(EngineCore pid=4242) ERROR 12-02 17:04:43 [core.py:1374] ValueError: To serve at least one request with the models's max seq len (32768), (0.03 GiB KV cache is needed, which is larger than the available KV cache memory (0.00 GiB).
Traceback (most recent call last):
  File "x.py", line 1, in <module>
zl-replica: error: vLLM did not start: RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""  # noqa: E501
API_SERVER_LOG = """\
Traceback (most recent call last):
  File "api_server.py", line 9, in <module>
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len (max_position_embeddings=2048.0). [type=value_error]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""  # noqa: E501


def test_a_part_that_exited_at_start_is_reported_by_its_reason() -> None:
    assert exit_reason("zl-replica: error: --engine-option: bad\n") == "--engine-option: bad"
    core = exit_reason(VLLM_CORE_LOG)
    assert core.startswith("vLLM did not start: RuntimeError: Engine core initialization failed.")
    assert "Root cause: ValueError: To serve at least one request" in core
    assert "\n" not in core and len(core) <= 403
    assert exit_reason(API_SERVER_LOG, "api_server") == (
        "ValidationError: ModelConfig: User-specified max_model_len (4096) is greater than the "
        "derived max_model_len (max_position_embeddings=2048.0). [type=value_error]"
    )
    assert exit_reason("") == "no output"
    assert exit_reason("starting\nKilled\n") == "Killed"
