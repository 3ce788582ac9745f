"""Placing a run on a Ray cluster, what needs no cluster: the placement file, naming and
assigning nodes, the sharded loader's shards, its merge check and clocks, and the command line's
refusals (the two-node cluster itself: test_cluster_run.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.cluster.nodes import ClusterNode, from_gcs, node_names, resolve
from harness.cluster.placement import (
    Placement,
    assign,
    check_names,
    parse_placement,
    pool_resource,
    read_placement,
)
from harness.loaders.sharded import (
    NOT_REPORTED,
    WORKER_LOST,
    Clock,
    WorkerReport,
    merge_check,
    shard_of,
    shards,
    shifted,
)
from harness.schema import PlacedProcess, RequestRecord
from harness.stacks import ALL_STACKS
from harness.workload import PlannedRequest

A = ClusterNode("a" * 56, "10.0.0.1", names=("gpu-a", "pool"), is_head=True)
B = ClusterNode("b" * 56, "10.0.0.2", names=("gpu-b", "pool"))
C = ClusterNode("c" * 56, "10.0.0.2", names=("client",))
GONE = ClusterNode("d" * 56, "10.0.0.4", names=("gpu-d",), alive=False)
NODES = [A, B, C, GONE]


def test_a_node_is_named_by_its_custom_resources_not_rays_own() -> None:
    resources = {"CPU": 8.0, "GPU": 1.0, "memory": 1e9, "node:10.0.0.1": 1.0, "gpu-a": 1.0,
                 "accelerator_type:H200": 1.0, "node:__internal_head__": 1.0}  # fmt: skip
    assert node_names(resources) == ("gpu-a",)
    node = from_gcs({"NodeID": "ab" * 28, "NodeManagerAddress": "10.0.0.1", "Alive": True,
                     "Resources": resources})  # fmt: skip
    assert node.is_head and node.label == "gpu-a" and node.alive


def test_a_name_resolves_by_resource_id_prefix_or_unique_address() -> None:
    assert resolve("gpu-b", NODES) is B
    assert resolve("cccccc", NODES) is C  # an id prefix of six or more
    assert resolve("10.0.0.1", NODES) is A  # one node has that address
    with pytest.raises(ValueError, match="names 2 nodes"):
        resolve("10.0.0.2", NODES)
    with pytest.raises(ValueError, match="no alive node of the cluster is named 'gpu-d'"):
        resolve("gpu-d", NODES)  # a dead node names nothing
    with pytest.raises(ValueError, match=r"its nodes: gpu-a \(10\.0\.0\.1"):
        resolve("gpu-z", NODES)


def test_assign_takes_the_named_nodes_in_turn_else_every_alive_node() -> None:
    assert assign(["gpu-b", "gpu-a"], 3, NODES) == [B, A, B]
    assert assign([], 4, NODES) == [A, B, C, A]  # the dead node is left out
    with pytest.raises(ValueError, match="no alive node"):
        assign([], 1, [GONE])


def test_the_placement_file_is_read_and_its_names_checked(tmp_path: Path) -> None:
    path = tmp_path / "placement.toml"
    path.write_text(
        '[stacks.zerolayer]\nnodes = ["gpu-a", "gpu-b"]\n'
        '[stacks.baseline]\nnodes = ["pool"]\n[loaders]\nnodes = ["client"]\n'
    )
    placement = read_placement(path, ALL_STACKS)
    assert placement.nodes_for("zerolayer") == ("gpu-a", "gpu-b")
    assert placement.nodes_for("loaders") == ("client",)
    assert placement.nodes_for("vllm-serve") == ()
    assert placement.describe()["file"] == str(path)
    check_names(placement, NODES, pools=("baseline",))  # "pool" names two nodes: a pool
    with pytest.raises(ValueError, match="'pool' names 2 nodes"):
        check_names(placement, NODES)  # ... which a node-by-node group may not take


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[nodes]\n", "unknown table"),
        ('[stacks.gateway]\nnodes = ["a"]\n', "unknown stack"),
        ("[stacks.zerolayer]\nnodes = []\n", "non-empty list"),
        ("[stacks.zerolayer]\nnodes = [1]\n", "node names"),
        ('[stacks.zerolayer]\nnodes = ["a"]\ncount = 2\n', "unknown key"),
        ("[loaders\n", "placement file"),
    ],
)
def test_a_bad_placement_file_is_one_line_naming_it(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error) as caught:
        read_placement(path, ALL_STACKS)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="does not exist"):
        read_placement(tmp_path / "none.toml", ALL_STACKS)


def test_serve_places_by_one_custom_resource_some_alive_node_holds() -> None:
    placement = parse_placement({"stacks": {"baseline": {"nodes": ["pool"]}}}, ALL_STACKS)
    assert pool_resource(placement, "baseline", NODES) == "pool"
    assert pool_resource(Placement(), "baseline", NODES) is None  # Serve's own placement
    two = parse_placement({"stacks": {"baseline": {"nodes": ["gpu-a", "gpu-b"]}}}, ALL_STACKS)
    with pytest.raises(ValueError, match="name one custom resource"):
        pool_resource(two, "baseline", NODES)
    gone = parse_placement({"stacks": {"baseline": {"nodes": ["gpu-d"]}}}, ALL_STACKS)
    with pytest.raises(ValueError, match="no alive node holds"):
        pool_resource(gone, "baseline", NODES)


def _request(index: int, session: str) -> PlannedRequest:
    return PlannedRequest(index, f"r{index}", index * 0.01, "small", 64, 4, index, session,
                          "t", "normal", 1000)  # fmt: skip


@st.composite
def schedules(draw: st.DrawFn) -> list[PlannedRequest]:
    sessions = draw(st.lists(st.sampled_from(["", "s1", "s2", "s3", "s4"]), max_size=60))
    return [_request(i, s) for i, s in enumerate(sessions)]


@given(schedules(), st.integers(min_value=1, max_value=7))
def test_shards_hold_the_schedule_once_each_session_whole_and_in_order(
    schedule: list[PlannedRequest], workers: int
) -> None:
    parts = shards(schedule, workers)
    assert len(parts) == workers
    merged = sorted((r for part in parts for r in part), key=lambda r: r.index)
    assert merged == schedule  # every request once
    for i, part in enumerate(parts):
        assert [r.index for r in part] == sorted(r.index for r in part)  # the schedule's order
        assert all(shard_of(r, workers) == i for r in part)
    for session in {r.session for r in schedule if r.session}:
        assert len({shard_of(r, workers) for r in schedule if r.session == session}) == 1
    assert shards(schedule, workers) == parts  # deterministic


def _record(req: PlannedRequest, start_ns: int = 1_000) -> RequestRecord:
    t = start_ns + int(req.offset_s * 1e9)
    return RequestRecord(req.request_id, "zerolayer", "a", "native", t, dispatch_ns=t + 1,
                         sent_ns=t + 2, first_token_ns=t + 3, end_ns=t + 9, chunk_ns=[t + 3, t + 5],
                         outcome="completed")  # fmt: skip


def _report(index: int, records: list[RequestRecord], error: str = "") -> WorkerReport:
    place = PlacedProcess("loader", "loader-worker", f"zl-loader-{index}", "n", "node", pid=1)
    return WorkerReport(index, place, Clock(0, 10), 0, records, error=error)


def test_the_merge_check_fills_what_no_worker_reported_and_names_doubles() -> None:
    schedule = [_request(i, f"s{i % 4}") for i in range(12)]
    parts = shards(schedule, 2)
    reports = [_report(0, [_record(r) for r in parts[0][1:]]), _report(1, [], error="lost")]
    fills, reasons = merge_check(schedule, reports, ("zerolayer", "a"), 1_000)
    assert {f.request_id for f in fills} == {parts[0][0].request_id} | {
        r.request_id for r in parts[1]
    }
    codes = {f.request_id: f.error_code for f in fills}
    assert codes[parts[0][0].request_id] == NOT_REPORTED
    assert all(codes[r.request_id] == WORKER_LOST for r in parts[1])
    assert all(f.outcome == "error" for f in fills) and reasons
    whole = [_report(0, [_record(r) for r in schedule]), _report(1, [_record(schedule[0])])]
    fills, reasons = merge_check(schedule, whole, ("zerolayer", "a"), 1_000)
    assert not fills and reasons == [
        "the merged records are not the schedule: 1 ids twice, 0 ids not scheduled"
    ]
    exact = [_report(0, [_record(r) for r in schedule]), _report(1, [])]
    assert merge_check(schedule, exact, ("zerolayer", "a"), 1_000) == ([], [])


def test_a_worker_record_is_moved_onto_the_drivers_clock() -> None:
    rec = _record(_request(3, "s"), start_ns=10_000)
    moved = shifted(orjson.dumps(rec), 500)
    assert moved.intended_start_ns == rec.intended_start_ns - 500
    assert moved.end_ns - moved.sent_ns == rec.end_ns - rec.sent_ns  # latencies unchanged
    assert moved.chunk_ns == [t - 500 for t in rec.chunk_ns]


def test_an_offset_within_its_round_trip_is_not_corrected() -> None:
    assert Clock(offset_ns=80_000, rtt_ns=800_000).applied_ns == 0  # one clock, as on one host
    assert Clock(offset_ns=-5_000_000, rtt_ns=800_000).applied_ns == -5_000_000


def _zl_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["run", "--placement", "p.toml"], "--placement says which nodes"),
        (["run", "--loader-workers", "2"], "--loader-workers runs the loader as Ray actors"),
        (["run", "--experiments", "no-such"], "no chaos experiment"),
        (["run", "--ray-address", "127.0.0.2:1"], "no Ray cluster answers at 127.0.0.2:1"),
        (["capacity", "--loader-workers", "2"], "--loader-workers runs the loader"),
        (["capacity", "--loader-workers", "1.5", "--ray-address", "x"], "whole numbers"),
    ],
)
def test_cluster_options_refused_in_one_line(args: list[str], error: str) -> None:
    proc = _zl_bench(*args, "--scale", "smoke") if args[0] == "run" else _zl_bench(*args)
    assert proc.returncode == 2, proc.stderr
    assert error in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


class _Session:
    """What node loss asks of the run's cluster session, without a cluster."""

    def __init__(self, nodes: list[ClusterNode], placed: list[PlacedProcess]) -> None:
        self._nodes, self._placed, self.driver_node = nodes, placed, nodes[0].node_id

    def nodes(self) -> list[ClusterNode]:
        return self._nodes

    def placed(self, group: str | None = None) -> list[PlacedProcess]:
        return [p for p in self._placed if group is None or p.group == group]


def test_node_loss_takes_a_worker_node_of_this_stack_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from chaos import nodes as chaos_nodes
    from chaos.targets import ReplicaSpec, Target

    w1 = ClusterNode("e" * 56, "10.0.0.5", names=("w1",))
    w2 = ClusterNode("f" * 56, "10.0.0.6", names=("w2",))
    replicas = [ReplicaSpec(f"http://h:{i}", 100 + i, i, [], node_id=n.node_id)
                for i, n in enumerate([A, B, B, w1, w2, w2])]  # fmt: skip
    target = Target("zerolayer", [r.url for r in replicas], "h2", replicas=replicas,
                    ray_address="ray:1")  # fmt: skip
    baseline_on_w2 = PlacedProcess("baseline", "engine", "e0", w2.node_id, "w2", pid=7)
    session = _Session([A, B, w1, w2], [baseline_on_w2])
    session.driver_node = B.node_id  # the driver's node is never taken, nor the head (A)
    monkeypatch.setattr(chaos_nodes, "current", lambda: session)
    assert chaos_nodes.victim(target) == w1  # w2 hosts more, but the baseline's too
    session._placed = []
    assert chaos_nodes.victim(target) == w2  # the most of this stack's replicas
    session._nodes = [A, B]
    assert chaos_nodes.victim(target) is None
