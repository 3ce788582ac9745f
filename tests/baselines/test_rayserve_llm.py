"""Ray Serve LLM (the baseline for the vLLM engine) on the CPU, serving the offline tiny model.

One baseline stack (``stand_up`` with ``engine="vllm"``: one local Ray and one ``LLMServer``
replica, about a minute to come up on two cores) for the whole module; a streamed completion over
HTTP/1.1 through the stack's own client, the recorded settings, and tear-down leaving no process
behind. Without vLLM or ``ray.serve.llm`` everything here skips.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.stacks import Stack, StackName, StackSpec, stand_up
from tests.support.peer_tools import check_bench_result, listed_model, vllm_bench_serve

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENGINE_OPTIONS = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 20, "max_num_seqs": 8}


def _has_serve_llm() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("ray") is None:
        return False
    try:
        import ray.serve.llm  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.vllm,
    # A hang guard: Ray Serve LLM stands up in about 90 s on a quiet 2-core host; beside the
    # tests session on a loaded one its first test took 909 s (CI), past the 900 s this was.
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not _has_serve_llm(),
        reason="vllm or ray.serve.llm is not importable (they install with: nox -s vllm)",
    ),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("llm-model") / "tiny")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("llm")
    model = tiny_model
    spec = StackSpec(
        StackName.BASELINE,
        engine="vllm",
        engine_options={"model": str(model), **ENGINE_OPTIONS},
        replicas=1,
    )
    with pytest.MonkeyPatch.context() as env:
        for key, value in OFFLINE.items():
            env.setenv(key, value)
        with stand_up(spec, root / "stack") as up:
            yield up


@pytest.fixture(scope="module")
def baseline(stack: Stack) -> object:
    return stack.baseline


def test_prefix_aware_router_is_configured_as_rays_docs_show(tmp_path: Path) -> None:
    """No Ray needed: the LLMConfig a user would write for the prefix-aware router."""
    from baselines.rayserve.config import BaselineRouter
    from baselines.rayserve_llm import LlmBaselineConfig

    config = LlmBaselineConfig(
        model=str(tmp_path / "tiny"),
        replicas=2,
        engine_options=ENGINE_OPTIONS,
        router=BaselineRouter.PREFIX_AWARE,
        router_kwargs={"imbalanced_threshold": 8},
    )
    llm = config.llm_config()
    router = llm.deployment_config["request_router_config"]
    assert router.request_router_class.endswith("PrefixCacheAffinityRouter")
    assert router.request_router_kwargs == {"imbalanced_threshold": 8}
    assert llm.deployment_config["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 2}
    assert llm.engine_kwargs["dtype"] == "float32" and llm.model_id == "tiny"
    with pytest.raises(ValueError, match="router"):
        LlmBaselineConfig(model="m", router="consistent_hash")  # type: ignore[arg-type]
    same = LlmBaselineConfig(model="m", engine_options={"model": "m", "max_num_seqs": 4})
    assert same.engine_options == {"max_num_seqs": 4}
    with pytest.raises(ValueError, match="model"):
        LlmBaselineConfig(model="m", engine_options={"model": "other"})
    with pytest.raises(TypeError):
        LlmBaselineConfig(model="m", engine_options={"no_such_option": 1})


def test_the_baseline_for_vllm_is_ray_serve_llm(stack: Stack) -> None:
    from baselines.rayserve_llm import LlmBaselineHandle

    assert isinstance(stack.baseline, LlmBaselineHandle)
    assert stack.metadata["label"].startswith("Ray Serve LLM")
    assert stack.protocol == "http1" and stack.urls == [stack.baseline.url]
    assert stack.body_fields()["model"] == stack.baseline.config.model_id == "tiny"
    roles = {c.role for c in stack.components()}
    # "ray": the local Ray's GCS, raylet and idle workers, which the layer pays for too
    assert roles == {"controller", "proxy", "orchestrator", "engine", "ray"}
    pids = stack.pids()  # the LLMServer actor and what it started (vLLM's engine core) are engine
    assert pids["ray"] and not set(pids["ray"]) & set(pids["engine"] + pids["orchestrator"])
    own = stack.baseline.pids()
    assert pids["orchestrator"] == own["ingress"] + own["router"] and len(own["ingress"]) == 1
    assert len(own["engine"]) == 1 and own["engine_core"]
    assert sorted(pids["engine"]) == sorted(own["engine"] + own["engine_core"])


def test_streams_exactly_max_tokens_through_the_stacks_client(stack: Stack) -> None:
    async def main() -> None:
        async with stack.open_client() as client:
            done = await client.complete(prompt="The baseline streams tokens", max_tokens=16)
        # Ray Serve LLM batches a stream's tokens for 50 ms by default
        # (stream_batching_interval_ms), so 16 tokens arrive in fewer SSE events than tokens.
        # The stack's body fields (ignore_eos, usage) make it serve all 16, counted by vLLM.
        assert done.timing.status == 200 and done.timing.finish_reason == "length"
        assert done.text and done.timing.first_token_ns > 0
        assert done.timing.output_tokens == 16
        assert 1 <= len(done.timing.chunk_ns) <= 16

    asyncio.run(asyncio.wait_for(main(), 60))


def test_vllm_bench_serve_completes_every_request(stack: Stack, tiny_model: Path) -> None:
    """vLLM's own benchmark client, a peer tool, finishes a short random run through Ray Serve
    LLM (the baseline with the vllm engine)."""
    url = stack.urls[0]
    check_bench_result(vllm_bench_serve(url, listed_model(url), tiny_model))


def test_metadata_records_the_router_and_settings(baseline: object) -> None:
    from baselines.rayserve_llm import LlmBaselineHandle

    assert isinstance(baseline, LlmBaselineHandle)
    meta = baseline.metadata
    assert meta["stack"] == "rayserve-llm" and meta["router"] == "pow2"  # Serve's default
    assert meta["router_class"].endswith("PowerOfTwoChoicesRequestRouter")
    assert meta["engine_replicas"] == 1 and meta["proxy_location"] == "HeadOnly"
    kwargs = meta["engine_kwargs"]
    assert kwargs["dtype"] == "float32" and kwargs["enforce_eager"] is True
    assert kwargs["max_model_len"] == 512 and "model" not in kwargs
    assert meta["placement_group_config"] == {"bundles": [{"CPU": 1}]}
    assert meta["ray_version"] and meta["vllm_version"]
    deployments = meta["deployments"]
    server = next(v for k, v in deployments.items() if k.startswith("LLMServer"))
    ingress = next(v for k, v in deployments.items() if k.startswith("OpenAiIngress"))
    assert server["autoscaling"]["min_replicas"] == server["autoscaling"]["max_replicas"] == 1
    assert server["max_ongoing_requests"] and ingress["max_ongoing_requests"]
    assert "MODEL_RESPONSE_BATCH_TIMEOUT_MS" in meta["llm_constants"]
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" in meta["serve_constants"]
    pids = meta["pids"]
    assert all(len(pids[r]) == 1 for r in ("controller", "proxy", "ingress", "engine"))
    assert pids["engine_core"], "vLLM's engine core runs as a child of the replica"


def test_engine_settings_are_the_applied_engine_arguments(stack: Stack) -> None:
    """As the LLMServer replica holds them: what the bench asked for, the CPU defaults beside."""
    (settings,) = stack.engine_settings().values()
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (8, 8192)
    assert (settings.max_model_len, settings.dtype, settings.temperature) == (512, "float32", 0.0)


def test_close_leaves_no_process(baseline: object) -> None:
    from baselines.rayserve_llm import LlmBaselineHandle

    assert isinstance(baseline, LlmBaselineHandle)
    processes = baseline.ray_processes()
    roles = baseline.pids()
    pids = [p for role in roles.values() for p in role]
    assert roles["engine_core"] and set(pids) <= {p.pid for p in processes}
    baseline.close()
    alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
    import ray

    assert not ray.is_initialized()
