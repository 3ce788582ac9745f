"""The one stand-up path: zero-layer (plain and TLS), external stacks, restarts by command; the
registry of stack kinds and what each kind answers."""

from __future__ import annotations

import asyncio
import http.server
import socket
import time
from pathlib import Path

import psutil
import pytest

from harness.loaders.base import replica_routes
from harness.stacks import (
    ALL_STACKS,
    REACH_TIMEOUT_S,
    STACK_KINDS,
    STACKS,
    START_GUARD_S,
    Fault,
    Http1Router,
    Restore,
    Stack,
    StackKind,
    StackName,
    StackSpec,
    StackUnreachable,
    check_spec,
    client_for,
    descendants,
    engine_args,
    kill_tree,
    kind_for,
    openai_server_body,
    processes,
    spawn_replica,
    stack_kind,
    stand_up,
    stop_pids,
    wait_listening,
)
from harness.stacks.external import ExternalKind
from harness.stacks.processes import StartFailed, VllmServer
from harness.stacks.rayserve import RayServeKind, RayServeLlmKind
from harness.stacks.zerolayer import ZeroLayerKind
from harness.workload import PlannedRequest
from serving.engine.vllm_engine import CPU_DEFAULTS, server_flags
from tests.support.httpserver import answering_url
from tests.support.waiting import HANG_GUARD_S
from zerolayer.client import Http1Client, ZeroLayerClient


def _complete(stack: Stack, n: int = 8) -> list[str]:
    """Send ``n`` requests over different sessions through the stack's own client."""

    async def go() -> list[str]:
        async with stack.open_client() as client:
            out = []
            for i in range(n):
                done = await client.complete(prompt=f"hello {i}", max_tokens=4, session=f"s{i}")
                out.append(done.text)
            return out

    return asyncio.run(go())


def test_engine_options_are_spelled_engine_option_key_json() -> None:
    args = engine_args("sim", {"num_kv_blocks": 64, "model_shape": "llama-3.1-8b"})
    assert args == ["--engine", "sim", "--engine-option", "num_kv_blocks=64",
                    "--engine-option", 'model_shape="llama-3.1-8b"']  # fmt: skip


def test_zerolayer_stack_serves_reports_and_stops(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=2)
    with stand_up(spec, tmp_path) as stack:
        assert not stack.external and stack.protocol == "h2" and stack.tls_ca is None
        assert len(set(stack.urls)) == 2 and all(u.startswith("http://") for u in stack.urls)
        pids = stack.pids()["replica"]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        assert {c.role for c in stack.components()} == {"replica"}
        assert len(_complete(stack)) == 8
        rows = [t.read() for t in stack.engine_targets()]
        assert len(rows) == 2 and all("running" in r for r in rows)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def test_tls_stack_trusts_its_own_certificate(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1, tls=True)
    with stand_up(spec, tmp_path) as stack:
        assert stack.tls_ca is not None and stack.tls_ca.exists()
        assert stack.urls[0].startswith("https://")
        client = stack.open_client()
        assert isinstance(client, ZeroLayerClient)
        assert len(_complete(stack, 2)) == 2
        assert "running" in stack.engine_targets()[0].read()


def test_unreachable_external_stack_is_refused_before_any_load(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, urls=("http://127.0.0.1:1",))
    start = time.monotonic()
    with pytest.raises(StackUnreachable, match=r"http://127\.0\.0\.1:1 .*not reachable"):
        stand_up(spec, tmp_path)
    assert time.monotonic() - start < REACH_TIMEOUT_S * 4  # bounded by the connect timeout
    with pytest.raises(StackUnreachable, match="not an http"):
        stand_up(StackSpec(StackName.BASELINE, urls=("ftp://127.0.0.1:21",)), tmp_path)


def test_reachable_external_stack_starts_and_stops_nothing(tmp_path: Path) -> None:
    with (
        answering_url() as url,
        stand_up(StackSpec(StackName.BASELINE, urls=(url,)), tmp_path) as stack,
    ):
        assert stack.external and stack.urls == [url] and stack.protocol == "http1"
        assert stack.pids() == {} and stack.engine_targets() == []
        assert stack.metadata["impl"] == "external"


def test_an_external_url_that_does_not_speak_http_is_unreachable(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(StackUnreachable, match=f"{url} does not answer HTTP"):
            stand_up(StackSpec(StackName.BASELINE, urls=(url,)), tmp_path)


def test_a_killed_replica_comes_back_with_its_command_and_is_adopted(tmp_path: Path) -> None:
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=2)
    with stand_up(spec, tmp_path) as stack:
        replica = stack.replicas[1]
        assert f"--port {replica.port}" in " ".join(replica.command)
        replica.kill()
        assert stack.pids()["replica"] == [stack.replicas[0].pid]
        proc = spawn_replica(replica.command, tmp_path / "again.log")
        assert wait_listening(tmp_path / "again.log", proc, time.monotonic() + 60) == replica.url
        stack.replica_restarted(replica.url, proc.pid)
        assert stack.pids()["replica"] == [stack.replicas[0].pid, proc.pid]
        assert len(_complete(stack)) == 8
    assert proc.poll() is not None, "close() stops an adopted replica too"


@pytest.mark.parametrize("engine", ["sim", "null"])
def test_every_zero_layer_replica_start_is_held_only_by_the_start_guard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """A start that fails exits, and ``wait_listening`` says so at once; one still running is
    still starting. A sim replica was held to a fixed 60 s, and a loaded host's did not listen in
    it (tests-under-load: 'replica zl-0 did not start: not listening in time; no output')."""
    asked: list[float] = []

    class Started:
        def __init__(self, *args: object, ready_timeout_s: float, **kwargs: object) -> None:
            asked.append(ready_timeout_s)

        def wait_ready(self) -> str:
            return ""

    monkeypatch.setattr("harness.stacks.zerolayer.ReplicaProcess", Started)
    spec = StackSpec(StackName.ZEROLAYER, engine=engine, replicas=2)
    assert len(ZeroLayerKind._start_replicas(spec, tmp_path, None)) == 2
    assert asked == [START_GUARD_S, START_GUARD_S]


def test_vllm_serve_is_a_stack_asked_for_by_name_and_needs_the_vllm_engine(tmp_path: Path) -> None:
    assert "vllm-serve" in ALL_STACKS and "vllm-serve" not in STACKS
    with pytest.raises(ValueError, match="needs --engine vllm"):
        stand_up(StackSpec(StackName.VLLM_SERVE, engine="sim", replicas=1), tmp_path)
    assert not list(tmp_path.iterdir()), "refused before anything starts"


def test_server_flags_carry_the_engine_config_and_its_cpu_defaults() -> None:
    flags = server_flags({"model": "/m", "max_model_len": 512, "max_num_seqs": 8}, on_cpu=True)
    pairs = dict(zip(flags, [*flags[1:], ""], strict=True))
    assert pairs["--model"] == "/m" and pairs["--max-model-len"] == "512"
    assert pairs["--max-num-seqs"] == "8" and pairs["--dtype"] == CPU_DEFAULTS["dtype"]
    assert pairs["--kv-cache-memory-bytes"] == str(CPU_DEFAULTS["kv_cache_memory_bytes"])
    assert "--enforce-eager" in flags and "--no-skip-tokenizer-init" in flags
    assert "--temperature" not in flags and "--disable-log-stats" not in flags
    gpu = server_flags({"model": "/m", "dtype": "bfloat16"}, on_cpu=False)
    assert "--kv-cache-memory-bytes" not in gpu and gpu[gpu.index("--dtype") + 1] == "bfloat16"


def test_http1_over_several_replicas_routes_by_the_sdk_ring(tmp_path: Path) -> None:
    """vllm-serve's client shape (one HTTP/1.1 client per replica, the ring picks), exercised on
    two zl-replicas, which speak HTTP/1.1 too; the loaders' plan routes the same way."""
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=2)
    with stand_up(spec, tmp_path) as replicas:
        peer = StackSpec(StackName.VLLM_SERVE, engine="vllm", replicas=2)
        # vllm-serve's shape over zl-replicas
        stack = Stack(peer, replicas.urls, kind=kind_for(peer), metadata={})
        router = stack.open_client()
        assert isinstance(router, Http1Router) and isinstance(router.pick("s1"), Http1Client)
        assert isinstance(client_for("http1", stack.urls[:1]), Http1Client)
        with pytest.raises(ValueError, match="exactly one URL"):
            client_for("http1", stack.urls)
        schedule = [
            PlannedRequest(i, f"r{i}", 0.0, "chat", 64, 4, i, f"s{i}", "t", "normal", 5000)
            for i in range(16)
        ]
        routes = replica_routes(schedule, stack)
        assert [router.pick(r.session).url for r in schedule] == routes
        assert set(routes) == set(stack.urls), "both replicas get a share"

        async def go() -> list[str]:
            async with router:
                done = [
                    await router.complete(prompt=f"hi {r.index}", max_tokens=3, session=r.session)
                    for r in schedule
                ]
            return [d.timing.replica for d in done]

        # each request answered by the replica the ring routes it to (so by both replicas, as
        # the routes are); the ring moves with the replicas' ports, so which ones is not fixed
        assert asyncio.run(go()) == routes


def test_a_stacks_model_and_body_fields_reach_every_client_and_loader(tmp_path: Path) -> None:
    """vLLM's servers (vllm-serve, Ray Serve LLM) need the model named, and ignore_eos to serve
    exactly max_tokens; the stack's own client and the k6/locust plans add them alike."""
    import orjson

    from harness.loaders.k6 import tls_trust, write_inputs

    extra = openai_server_body({"model": "/m/tiny", "temperature": 0.5})
    assert extra == {
        "ignore_eos": True,
        "temperature": 0.5,
        "stream_options": {"include_usage": True},
    }
    spec = StackSpec(StackName.VLLM_SERVE, engine="vllm", replicas=2)
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    stack = Stack(spec, urls, kind=kind_for(spec), metadata={}, model="tiny", extra_body=extra)
    assert stack.body_fields() == {"model": "tiny", **extra}
    router = stack.open_client()
    assert isinstance(router, Http1Router)
    for client in router.clients.values():
        body = orjson.loads(client._issue({"prompt": "p", "max_tokens": 3}).body)
        assert body["model"] == "tiny" and body["ignore_eos"] is True
    zl = StackSpec(StackName.ZEROLAYER)
    plain = Stack(zl, urls, kind=kind_for(zl), metadata={})
    assert plain.body_fields() == {}
    schedule = [PlannedRequest(0, "r0", 0.0, "a", 64, 4, 0, "s", "t", "normal", 5000)]
    paths = write_inputs(
        schedule, urls[:1], tmp_path, rate=1.0, duration_s=1.0, vus=1, grace_s=1.0,
        trust=tls_trust(urls, None), extra_body=stack.body_fields(),
    )  # fmt: skip
    assert orjson.loads(paths["config"].read_bytes())["extra_body"] == stack.body_fields()
    with pytest.raises(ValueError, match="baseline router"):
        check_spec(StackSpec(StackName.BASELINE, engine="vllm", baseline_router="random"))  # type: ignore[arg-type]


def test_profile_d_skips_vllm_serve_with_a_line(capsys: pytest.CaptureFixture[str]) -> None:

    from bench.run import FAULT_PROFILE, _fault_stacks
    from harness.profile import load_profile

    spec = StackSpec(StackName.VLLM_SERVE, engine="vllm", replicas=1)
    stack = Stack(spec, ["http://127.0.0.1:1"], kind=kind_for(spec), metadata={})
    profile = load_profile(FAULT_PROFILE, "smoke", None)
    assert _fault_stacks([stack], profile) == []
    assert "faults are defined for the zero-layer and baseline stacks" in capsys.readouterr().out


PARENT_OF_A_SLEEPER = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
)


@pytest.mark.parametrize("end", ["kill_tree", "stop_pids"])
def test_ending_a_process_ends_what_it_started(tmp_path: Path, end: str) -> None:
    """A replica over vLLM has a child (the engine core): a kill or a stop must not orphan it."""
    import sys

    log = tmp_path / "parent.log"
    proc = spawn_replica([sys.executable, "-c", PARENT_OF_A_SLEEPER], log)
    try:
        deadline = time.monotonic() + 30
        while not descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = descendants(proc.pid)
        assert children, "the parent started its child"
        if end == "kill_tree":
            assert proc.pid in kill_tree(proc.pid)
        else:
            stop_pids([proc.pid], timeout_s=2.0)
        _, alive = psutil.wait_procs(children, timeout=HANG_GUARD_S)
        assert not alive, [p.pid for p in alive]
    finally:
        proc.kill()
        proc.wait()


# the registry of stack kinds


def test_every_stack_name_has_a_kind_that_answers_the_protocol() -> None:
    assert set(STACK_KINDS) == set(StackName)
    for name in StackName:
        kind = stack_kind(name)
        assert isinstance(kind, StackKind) and kind.name is name and kind.summary
        assert kind.protocol in ("h2", "http1") and kind.engine_role in ("replica", "engine")
        assert isinstance(kind.restore, Restore) and kind.ready_path.startswith("/")
        assert stack_kind(name.value) is kind, "a target file's string names the same kind"
    assert stack_kind(StackName.ZEROLAYER).protocol == "h2"


def test_faults_apply_to_the_zero_layer_and_the_baselines_not_vllm_serve() -> None:
    everything = frozenset(Fault)
    assert stack_kind(StackName.ZEROLAYER).faults == everything
    assert stack_kind(StackName.BASELINE).faults == everything
    assert stack_kind(StackName.BASELINE, "llm").faults == everything
    assert stack_kind(StackName.VLLM_SERVE).faults == frozenset()
    assert STACKS == ("zerolayer", "baseline"), "the stacks with faults are the default ones"
    running = kind_for(StackSpec(StackName.ZEROLAYER, urls=("http://127.0.0.1:1",)))
    assert running.faults == frozenset() and running.restore is Restore.NONE


def test_how_a_killed_part_comes_back_and_when_a_stack_is_whole() -> None:
    zl, bl = stack_kind(StackName.ZEROLAYER), stack_kind(StackName.BASELINE)
    assert zl.restore is Restore.BY_COMMAND and bl.restore is Restore.BY_CONTROLLER
    assert zl.is_whole({"replica": [1, 2]}, 2) and not zl.is_whole({"replica": [1]}, 2)
    assert bl.is_whole({"engine": [1, 2], "orchestrator": [3]}, 2)
    assert not bl.is_whole({"engine": [1, 2]}, 2), "no orchestrator: nothing answers"
    with pytest.raises(ValueError, match="not restarted by command"):
        bl.restart(["true"], "/dev/null")
    assert bl.cluster_pids() is None, "not attached to Ray here: the target file's pids hold"
    assert zl.cluster_pids() is None


def test_the_kind_of_a_spec_follows_its_engine_kind_and_its_urls() -> None:
    assert type(kind_for(StackSpec(StackName.BASELINE, engine="sim"))) is RayServeKind
    llm = kind_for(StackSpec(StackName.BASELINE, engine="vllm"))
    assert isinstance(llm, RayServeLlmKind) and llm is stack_kind(StackName.BASELINE, "llm")
    assert llm.ready_path == "/v1/models" and llm.app == "llm"
    external = kind_for(StackSpec(StackName.VLLM_SERVE, urls=("http://127.0.0.1:1",)))
    assert isinstance(external, ExternalKind) and external.name is StackName.VLLM_SERVE
    assert external.client_routes and external.protocol == "http1"
    assert stack_kind(StackName.ZEROLAYER).client_routes
    assert not stack_kind(StackName.BASELINE).client_routes


def test_an_unknown_stack_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown stack 'nginx'; choose from zerolayer, baseline"):
        stack_kind("nginx")
    with pytest.raises(ValueError, match="no kind running the Ray Serve app 'llm'"):
        stack_kind(StackName.ZEROLAYER, "llm")


class _Healthy(http.server.BaseHTTPRequestHandler):
    """Another server: answers every GET 200, as a replica's ``/health`` does."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


def test_a_vllm_server_is_not_ready_while_another_process_answers_on_its_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The port picked free for vLLM's server was taken by another process before the server
    # bound it (CI: a zl-replica on an ephemeral port answered model_not_found to every
    # request). Here the server is one that never binds (http.server refusing vLLM's flags).
    with answering_url(_Healthy) as other:
        port = int(other.rsplit(":", 1)[1])
        monkeypatch.setattr(processes, "free_port", lambda host="127.0.0.1": port)
        monkeypatch.setattr(processes, "VLLM_SERVER_MODULE", "http.server")
        server = VllmServer({"model": "x"}, tmp_path / "server.log", ready_timeout_s=60)
        try:
            with pytest.raises(StartFailed):
                server.wait_ready()
        finally:
            server.stop()
