"""The step-time model reproduces the measured H200 timings it was calibrated on."""

from __future__ import annotations

import pytest

from serving.engine.stepmodel import MODEL_SHAPES, StepTimeModel, load_profile, model_shape

PROFILE = load_profile()


@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_decode_within_10_percent_of_every_graph_point(shape: str) -> None:
    model = StepTimeModel(model_shape(shape, PROFILE))
    points = PROFILE["models"][shape]["decode_step_graph_ms"]
    assert len(points) >= 10
    for key, point in points.items():
        batch, context = (int(v) for v in key.split("x"))
        predicted = model.decode_ms(batch, context)
        assert predicted == pytest.approx(point["ms"], rel=0.10), key


@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_prefill_fits_graph_points_and_grows(shape: str) -> None:
    model = StepTimeModel(model_shape(shape, PROFILE))
    for length, ms in PROFILE["models"][shape]["prefill_graph_ms"].items():
        assert model.prefill_ms(int(length)) == pytest.approx(ms, rel=0.10)
    assert model.prefill_ms(4000) > model.prefill_ms(2000) > model.prefill_ms(1000)
    chunks = model.prefill_ms(1000, 0, alone=False) + model.prefill_ms(1000, 1000, alone=False)
    assert chunks == pytest.approx(model.prefill_ms(2000, 0, alone=False), rel=1e-9)


def test_decode_is_monotone_in_batch_and_context() -> None:
    model = StepTimeModel(model_shape("llama-3.1-8b", PROFILE))
    for context in (256, 512, 1000, 4096):
        times = [model.decode_ms(b, context) for b in (1, 4, 16, 48, 100, 200, 300)]
        assert times == sorted(times)
    for batch in (1, 10, 64, 200):
        times = [model.decode_ms(batch, c) for c in (128, 512, 2048, 8192, 16384)]
        assert times == sorted(times)


def test_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"llama-3\.1-8b"):
        model_shape("gpt-5", PROFILE)
