"""The baselines' request routers as options: one spelling (``pow2``, ``consistent-hash``,
``prefix-aware``) for both baselines, each baseline's own default, and one-line refusals of what a
baseline cannot run. All but the last test run without Ray; the last stands the orchestrator up
with pow2 (one local Ray, about 20 s on 2 cores) and reads back from Serve which router it runs.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from baselines.rayserve.config import (
    BASELINE_ROUTERS,
    CONSISTENT_HASH_ROUTER,
    POW2_ROUTER,
    BaselineConfig,
    BaselineRouter,
    orchestrator_router,
    parse_router,
)
from baselines.rayserve.standup import environment
from baselines.rayserve_llm.config import (
    PREFIX_AWARE_ROUTER,
    SESSION_HEADER_VARIABLE,
    LlmBaselineConfig,
)
from baselines.rayserve_llm.standup import check_session_header
from bench import cli
from harness.stacks import StackName, StackSpec, baseline_router, check_spec
from serving.wire.contract import SESSION
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = STACK_IN_A_FIXTURE

TIMEOUT_S = 20.0


def test_one_spelling_for_every_router() -> None:
    assert BASELINE_ROUTERS == ("pow2", "consistent-hash", "prefix-aware")
    assert [parse_router(name) for name in BASELINE_ROUTERS] == list(BaselineRouter)
    for old in ("consistent_hash", "default", "Pow2"):
        with pytest.raises(ValueError, match="baseline router must be one of pow2, consistent-"):
            parse_router(old)


@given(st.text(max_size=20))
def test_any_other_text_is_refused_in_one_line(text: str) -> None:
    try:
        router = parse_router(text)
    except ValueError as exc:
        assert text not in BASELINE_ROUTERS
        assert "\n" not in str(exc)  # the text shows as its repr
    else:
        assert router.value == text


def test_the_orchestrator_maps_its_routers_to_rays_classes() -> None:
    hashed = BaselineConfig(router=BaselineRouter.CONSISTENT_HASH)
    assert hashed.router_class() == CONSISTENT_HASH_ROUTER
    assert hashed.router_kwargs() == {"num_virtual_nodes": 100, "num_fallback_replicas": 2}
    pow2 = BaselineConfig(router=BaselineRouter.POW2)
    assert pow2.router_class() == POW2_ROUTER and pow2.router_kwargs() == {}
    assert pow2.metadata()["router"] == "pow2"
    assert pow2.metadata()["router_class"] == POW2_ROUTER
    assert BaselineConfig().router is BaselineRouter.CONSISTENT_HASH  # docs/design.md's choice


def test_the_orchestrator_refuses_prefix_aware_in_one_line() -> None:
    with pytest.raises(ValueError, match="Ray Serve LLM's") as refused:
        orchestrator_router("prefix-aware")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="Ray Serve LLM's"):
        BaselineConfig(router=BaselineRouter.PREFIX_AWARE)


@pytest.mark.parametrize(
    ("path"), [POW2_ROUTER, CONSISTENT_HASH_ROUTER], ids=["pow2", "consistent-hash"]
)
def test_the_orchestrators_class_paths_name_classes_in_the_installed_ray(path: str) -> None:
    module, name = path.split(":")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def test_ray_serve_llm_maps_every_router_and_keys_hashing_on_zl_session() -> None:
    default = LlmBaselineConfig(model="m")
    assert default.router is BaselineRouter.POW2  # Serve's own default, left unset
    assert default.request_router_config() is None and default.serve_env() == {}
    assert default.metadata()["router_class"] == POW2_ROUTER
    hashed = LlmBaselineConfig(model="m", router=BaselineRouter.CONSISTENT_HASH)
    config = hashed.request_router_config()
    assert config is not None and config["request_router_class"] == CONSISTENT_HASH_ROUTER
    assert hashed.serve_env() == {SESSION_HEADER_VARIABLE: SESSION}
    assert hashed.metadata()["session_header"] == SESSION
    prefix = LlmBaselineConfig(model="m", router=BaselineRouter.PREFIX_AWARE)
    config = prefix.request_router_config()
    assert config is not None and config["request_router_class"] == PREFIX_AWARE_ROUTER
    assert prefix.serve_env() == {}
    with pytest.raises(ValueError, match="baseline router"):
        LlmBaselineConfig(model="m", router="default")  # type: ignore[arg-type]


def test_consistent_hashing_needs_serve_to_read_the_session_header() -> None:
    check_session_header({"SERVE_SESSION_ID": SESSION})
    with pytest.raises(ValueError, match=f"{SESSION_HEADER_VARIABLE}={SESSION}"):
        check_session_header({"SERVE_SESSION_ID": "x-session-id"})


def test_the_environment_ray_inherits_is_restored_after() -> None:
    name = "ZL_ROUTER_PROBE"
    assert name not in os.environ
    with environment({name: "1", "PATH": "/nowhere"}):
        assert os.environ[name] == "1" and os.environ["PATH"] == "/nowhere"
    assert name not in os.environ and os.environ["PATH"] != "/nowhere"


@pytest.mark.parametrize(
    ("engine", "asked", "runs"),
    [
        ("sim", None, BaselineRouter.CONSISTENT_HASH),
        ("null", BaselineRouter.POW2, BaselineRouter.POW2),
        ("vllm", None, BaselineRouter.POW2),
        ("vllm", BaselineRouter.CONSISTENT_HASH, BaselineRouter.CONSISTENT_HASH),
        ("vllm", BaselineRouter.PREFIX_AWARE, BaselineRouter.PREFIX_AWARE),
    ],
)
def test_each_baseline_runs_the_router_asked_for_or_its_own_default(
    engine: str, asked: BaselineRouter | None, runs: BaselineRouter
) -> None:
    spec = StackSpec(StackName.BASELINE, engine=engine, baseline_router=asked)
    check_spec(spec)
    assert baseline_router(spec) is runs


def test_check_spec_refuses_what_a_baseline_cannot_run() -> None:
    with pytest.raises(ValueError, match="Ray Serve LLM's"):
        check_spec(StackSpec(StackName.BASELINE, baseline_router=BaselineRouter.PREFIX_AWARE))
    running = ("http://127.0.0.1:1",)
    check_spec(StackSpec(StackName.BASELINE, urls=running))
    with pytest.raises(ValueError, match="keeps the router it was started with"):
        check_spec(StackSpec(StackName.BASELINE, urls=running, baseline_router=BaselineRouter.POW2))


def _bench_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("command", ["run", "sweep"])
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--baseline-router", "consistent_hash"], "baseline router must be one of pow2,"),
        (["--baseline-router", "prefix-aware"], "Ray Serve LLM's"),
        (
            ["--baseline-router", "pow2", "--baseline-url", "http://127.0.0.1:1"],
            "keeps the router it was started with",
        ),
    ],
    ids=["old spelling", "prefix-aware on the orchestrator", "running baseline"],
)
def test_bench_router_mistakes_are_one_line_exit_2_before_anything_starts(
    command: str,
    argv: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    profile = ["--profiles", "a"] if command == "run" else ["--profile", "a"]
    err = _bench_error(
        [command, *profile, "--scale", "smoke", "--out", str(tmp_path), *argv], capsys
    )
    assert says in err
    assert not any(tmp_path.iterdir()), "nothing is written for a mistake"


def _complete(port: int, session: str, prompt: str = "route me") -> bytes:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        body = orjson.dumps({"prompt": prompt, "max_tokens": 4, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={SESSION: session})
        response = conn.getresponse()
        assert response.status == 200
        return response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def pow2_baseline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from baselines.rayserve import start_baseline

    stats_dir = tmp_path_factory.mktemp("stats")
    handle = start_baseline(
        engine="sim", replicas=2, router=BaselineRouter.POW2, stats_dir=str(stats_dir)
    )
    try:
        yield handle
    finally:
        handle.close()


def wait_for(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``done`` until it holds; fail (not hang) if it never does."""
    end = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < end, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.2)


def _engine_field(stats_dir: Path, key: str) -> list[int]:
    """Each engine replica's ``key`` (an EngineStats field) in its last published snapshot."""
    values = []
    for path in sorted(stats_dir.glob("engine-stats-*.jsonl")):
        lines = path.read_bytes().splitlines()
        values.append(orjson.loads(lines[-1])[key] if lines else 0)
    return values


def test_the_orchestrator_with_pow2_runs_serves_pow2_router(pow2_baseline: object) -> None:
    """Serve's controller (not our config) says which router the engine deployment runs; one
    session's requests all complete and, unlike under consistent hashing, reach both replicas."""
    from ray.serve.context import _get_global_client

    from baselines.rayserve import BaselineHandle
    from baselines.rayserve.config import APP_NAME, ENGINE_NAME

    assert isinstance(pow2_baseline, BaselineHandle)
    client = _get_global_client()
    assert client is not None
    deployments = client.get_serve_details()["applications"][APP_NAME]["deployments"]
    router = deployments[ENGINE_NAME]["deployment_config"]["request_router_config"]
    assert router["request_router_class"] == POW2_ROUTER
    assert pow2_baseline.metadata["router"] == "pow2"
    assert pow2_baseline.metadata["router_class"] == POW2_ROUTER
    port = pow2_baseline.config.port
    for _ in range(16):  # all on one replica by chance: 2 * 2**-16
        assert _complete(port, "one-session").endswith(b"data: [DONE]\n\n")
    stats_dir = Path(str(pow2_baseline.config.stats_dir))
    wait_for(
        lambda: len(s := _engine_field(stats_dir, "steps")) == 2 and all(s),
        TIMEOUT_S,
        "both engine replicas publishing steps",
    )
    # The ingress forwards the prompt, so the engines' prefix cache works behind it: of three
    # sends of one long prompt two reach the same replica, whose cache then holds its blocks.
    prompt = "a prompt long enough to fill several KV blocks of the sim engine " * 8
    for _ in range(3):
        assert _complete(port, "cached", prompt).endswith(b"data: [DONE]\n\n")
    wait_for(
        lambda: sum(_engine_field(stats_dir, "prefix_cache_hits")) > 0,
        TIMEOUT_S,
        "a prefix-cache hit behind the orchestrator",
    )
    processes = pow2_baseline.ray_processes()
    pow2_baseline.close()
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    with socket.socket() as sock:  # the front door is gone with Serve
        assert sock.connect_ex(("127.0.0.1", port)) != 0
