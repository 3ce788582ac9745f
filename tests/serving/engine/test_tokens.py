"""Token rules: the bytes rule both ways, a model's tokenizer counting as the vLLM engine charges,
the rule each engine gets, synthetic classes resized for a tokenizer, and run.json's record.

The tokenizer tests need ``transformers`` (the vllm venv: ``nox -s vllm``) and skip without it;
the replica test also needs vLLM's own tokenizer loader.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.errors import UsageError
from harness.profile import SCALES, load_profile
from harness.promptfit import (
    CLAMP_MARGIN,
    class_fits,
    context_length,
    fit_classes,
    scaled_bytes,
    target_tokens,
)
from harness.runner.config import RunConfig, choose_token_rule
from harness.runner.results import RunDir
from serving.engine import engine_kind
from serving.engine.tokenrules import BYTES_RULE, TokenizerRule, TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN
from tests.support.models import BpeLikeRule

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# The real tokenizer's tests are marked ``vllm``: they run in ``nox -s vllm``, where it is.
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers is not installed (the vllm venv: nox -s vllm)"
)
SYNTHETIC_PROFILES = ("a_latency", "b_high_concurrency", "c_mixed")


# -- the bytes rule ---------------------------------------------------------------------------


@given(st.integers(min_value=1, max_value=50_000), st.integers(min_value=0, max_value=2**63 - 1))
def test_bytes_rule_text_counts_exactly_the_tokens_asked(tokens: int, seed: int) -> None:
    text = BYTES_RULE.text(tokens, seed)
    assert len(text.encode()) == tokens * BYTES_PER_TOKEN
    assert BYTES_RULE.count(text) == tokens
    assert BYTES_RULE.text(tokens, seed) == text


@given(st.text(max_size=400))
def test_bytes_rule_counts_four_bytes_a_token_at_least_one(text: str) -> None:
    size = len(text.encode())
    assert BYTES_RULE.count(text) == max(1, math.ceil(size / BYTES_PER_TOKEN))


# -- which rule an engine gets ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "options"),
    [
        ("sim", {}),
        ("null", {}),
        ("torch", {"model_shape": "tiny"}),
        ("sim", {"model": "/not/read"}),  # only vLLM reads a model directory's tokenizer
        ("vllm", {}),
        ("vllm", {"model": "/not/read", "skip_tokenizer_init": True}),
    ],
)
def test_engines_without_a_tokenizer_keep_the_bytes_rule(
    engine: str, options: dict[str, Any]
) -> None:
    assert engine_kind(engine).token_rule(options) is BYTES_RULE
    assert isinstance(BYTES_RULE, TokenRule) and BYTES_RULE.name == "bytes/4"


def test_vllm_over_a_missing_directory_is_a_mistake(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local model directory"):
        engine_kind("vllm").token_rule({"model": str(tmp_path / "none")})


@pytest.mark.skipif(HAVE_TRANSFORMERS, reason="checks the message where transformers is absent")
def test_a_tokenizer_without_transformers_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs transformers"):
        engine_kind("vllm").token_rule({"model": str(tmp_path)})


@pytest.mark.vllm
@needs_transformers
def test_a_directory_without_a_tokenizer_is_a_mistake(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer does not load"):
        engine_kind("vllm").token_rule({"model": str(tmp_path)})


def test_the_context_is_the_option_or_the_models_positions(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert context_length({"model": str(tmp_path)}) == 4096
    assert context_length({"model": str(tmp_path), "max_model_len": 2048}) == 2048
    assert context_length({"model": str(tmp_path / "none")}) is None
    assert context_length({}) is None


# -- synthetic classes resized for a rule ------------------------------------------------------


@given(
    st.integers(min_value=1, max_value=20_000),
    st.integers(min_value=1, max_value=2_000),
    st.integers(min_value=2_100, max_value=10_000),
)
def test_target_tokens_keep_the_profile_or_fit_the_context(
    intended: int, max_tokens: int, max_model_len: int
) -> None:
    got = target_tokens(intended, max_tokens, max_model_len)
    assert 1 <= got <= intended
    assert got + max_tokens <= max_model_len
    if intended + max_tokens <= max_model_len:
        assert got == intended
    else:
        assert got == math.floor((max_model_len - max_tokens) * (1 - CLAMP_MARGIN))
    assert target_tokens(intended, max_tokens, None) == intended


def test_no_room_for_the_output_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        target_tokens(10, 4096, 4096)


def test_scaled_bytes_follow_the_samples_bytes_per_token() -> None:
    assert scaled_bytes(1000, 1320, 1000) == 1320
    assert scaled_bytes(1, 10, 100) == 1
    with pytest.raises(ValueError):
        scaled_bytes(10, 0, 5)


def test_fitting_gives_each_class_its_token_count_and_clamps_only_the_large() -> None:
    rule = BpeLikeRule()
    profile = load_profile("c_mixed", "laptop")
    fits = class_fits(profile, rule, 4096)
    fitted = fit_classes(profile, rule, 4096)
    by_name = {f.name: f for f in fits}
    assert not by_name["small"].clamped and not by_name["medium"].clamped
    assert by_name["large"].clamped
    assert "clamped to fit max_model_len" in by_name["large"].line()
    for cls, fit in zip(fitted.classes, fits, strict=True):
        assert cls.prompt_bytes == fit.bytes_after
        assert abs(rule.count("x" * cls.prompt_bytes) - fit.target_tokens) <= 1
        assert fit.target_tokens + cls.max_tokens <= 4096
    assert replace(fitted, classes=profile.classes) == profile  # only the prompt sizes change


@pytest.mark.parametrize("name", SYNTHETIC_PROFILES)
@pytest.mark.parametrize("scale", SCALES)
def test_the_bytes_rule_leaves_every_profile_as_it_is(name: str, scale: str) -> None:
    profile = load_profile(name, scale)
    assert fit_classes(profile, BYTES_RULE) == profile
    assert all(
        f.line().endswith(f"{f.intended_tokens} at 4 B a token)")
        for f in class_fits(profile, BYTES_RULE, None)
    )


# -- run.json records the rule ------------------------------------------------------------------


def test_run_json_records_the_token_rule(tmp_path: Path) -> None:
    plain = RunDir(RunConfig(out=str(tmp_path / "a")))
    assert json.loads((plain.path / "run.json").read_text())["token_rule"] == "bytes/4"
    counted = RunDir(RunConfig(out=str(tmp_path / "b"), engine="vllm"), rule=BpeLikeRule())
    doc = json.loads((counted.path / "run.json").read_text())
    assert doc["token_rule"] == "tokenizer:bpe-like" and counted.rule.name == doc["token_rule"]


def test_a_tokenizer_that_does_not_load_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    config = RunConfig(out=str(tmp_path), engine="vllm", engine_options={"model": "/none"})
    with pytest.raises(UsageError, match="not a local model directory"):
        choose_token_rule(config, [load_profile("a_latency", "smoke")])
    assert not list(tmp_path.iterdir())
    assert choose_token_rule(RunConfig(out=str(tmp_path)), []) is BYTES_RULE


# -- a real tokenizer: the tiny model's ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_TRANSFORMERS:
        pytest.skip("transformers is not installed (the vllm venv: nox -s vllm)")
    from bench.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tokens") / "tiny")


@pytest.fixture(scope="module")
def tiny_rule(tiny_model: Path) -> TokenizerRule:
    rule = engine_kind("vllm").token_rule({"model": str(tiny_model)})
    assert isinstance(rule, TokenizerRule)
    return rule


@pytest.mark.vllm
def test_vllm_over_a_model_directory_counts_with_its_tokenizer(
    tiny_model: Path, tiny_rule: TokenizerRule
) -> None:
    assert tiny_rule.name == "tokenizer:tiny"
    assert isinstance(tiny_rule, TokenRule)
    text = BYTES_RULE.text(1000, 3)
    assert tiny_rule.count(text) > BYTES_RULE.count(text)  # BPE: about 1.3 bytes a token
    assert tiny_rule.count("") == 1


@pytest.mark.vllm
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(min_value=1, max_value=5_000), st.integers(min_value=0, max_value=2**63 - 1))
def test_tokenizer_text_is_exactly_the_tokens_asked(
    tiny_rule: TokenizerRule, tokens: int, seed: int
) -> None:
    """Exact on the tiny model (the documented tolerance, a token or two at the cut, is for
    tokenizers whose merges cross every cut tried)."""
    text = tiny_rule.text(tokens, seed)
    assert tiny_rule.count(text) == tokens
    assert tiny_rule.text(tokens, seed) == text


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["a_latency", "c_mixed"])
def test_synthetic_prompts_keep_their_class_token_counts_under_a_tokenizer(
    tiny_rule: TokenizerRule, name: str
) -> None:
    """Each class's prompts, resized for the tokenizer, come within 2 % of the class's tokens
    (the model's bytes per token are about a third of the profile's four), and each request
    announces the rule's own count of its prompt."""
    from harness.runner.drive import schedule_for

    profile = load_profile(name, "smoke")
    schedule = schedule_for(profile, tiny_rule, {"max_model_len": 100_000})
    wanted = {c.name: c.prompt_tokens for c in profile.classes}
    requests = list(schedule)[:20]
    for request in requests:
        counted = tiny_rule.count(request.prompt())
        assert abs(counted - wanted[request.request_class]) <= 0.02 * wanted[request.request_class]
        assert len(request.prompt().encode()) < 0.5 * BYTES_PER_TOKEN * counted
    assert [r.prompt_tokens for r in requests] == [tiny_rule.count(r.prompt()) for r in requests]


@pytest.mark.vllm
def test_kv_pressure_prompts_fit_the_context_under_the_models_tokenizer(
    tiny_model: Path, tiny_rule: TokenizerRule
) -> None:
    """Profile D's KV-pressure prompts, as its action builds them, come within 2 % of their
    tokens under the model's own tokenizer and leave the output room in a 2,048-token context
    (at four bytes a token they were three times as long and every one was refused)."""
    from chaos.pressure import kv_prompt
    from chaos.runner import chaos_settings
    from harness.stacks import StackName, StackSpec
    from harness.workload import make_prompt

    sc = chaos_settings(load_profile("d_fault", "smoke"))
    options = {"model": str(tiny_model), "max_model_len": 2048}
    prompt = kv_prompt(StackSpec(StackName.ZEROLAYER, "vllm", options, 1), sc)
    assert prompt.tokens + sc.kv_max_tokens <= 2048
    for i in range(sc.kv_requests):
        counted = tiny_rule.count(make_prompt(f"kv-pressure-1-{i}", prompt.prompt_bytes))
        assert abs(counted - prompt.tokens) <= 0.02 * prompt.tokens, i
        assert counted + sc.kv_max_tokens <= 2048, i


@pytest.mark.vllm
def test_the_replica_charges_what_the_rule_counted(
    tiny_model: Path, tiny_rule: TokenizerRule
) -> None:
    """A replica serving the vLLM adapter, over a stand-in engine core that hands it the
    tokenizer vLLM itself loads for the model: ``usage.prompt_tokens`` is the rule's count."""
    tokenizers = pytest.importorskip("vllm.tokenizers", reason="vLLM's tokenizer loader")
    from serving.engine.vllm_engine import VllmApi, VllmEngine, VllmEngineConfig
    from tests.support.fake_vllm import DELTA, FakeAsyncLLMForTests
    from tests.support.server_client import H2Client, wait_all
    from zerolayer.server import start_replica

    class EngineCoreWithTokenizer(FakeAsyncLLMForTests):
        def get_tokenizer(self) -> Any:
            return tokenizers.get_tokenizer(str(tiny_model))

    prompts = [tiny_rule.text(n, seed) for seed, n in enumerate((1, 7, 128, 900))]
    prompts.append(BYTES_RULE.text(300, 5))  # text the rule did not make: counted all the same

    async def charged() -> list[int]:
        api = VllmApi(EngineCoreWithTokenizer, dict, dict, DELTA, None)
        engine = VllmEngine(VllmEngineConfig(model=str(tiny_model)), api=api)
        replica = await start_replica(engine, name="tokens")
        client = await H2Client.connect("127.0.0.1", replica.port)
        try:
            streams = [client.completion(p, max_tokens=2) for p in prompts]
            await wait_all(streams, 30)
            return [s.json()["usage"]["prompt_tokens"] for s in streams]
        finally:
            await client.close()
            await replica.close()
            await engine.close()

    assert asyncio.run(charged()) == [tiny_rule.count(p) for p in prompts]
    assert [tiny_rule.count(p) for p in prompts[:4]] == [1, 7, 128, 900]
