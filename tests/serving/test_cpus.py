"""CPU layouts (``serving.cpus``): the split of the cores among vLLM engine replicas and the rest,
``--cpu-layout`` checked, the engine's processes started on its cores with vLLM's OpenMP binding
and a front end's threads moved to the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving import cpus
from serving.cpus import (
    BIND_VARIABLE,
    CpuLayout,
    LayoutError,
    cores_text,
    engine_cores,
    layout_text,
    parse_cores,
    parse_layout,
    pin_threads,
    split_cores,
)

core_sets = st.sets(st.integers(0, 200), min_size=1, max_size=40)


@settings(deadline=None)
@given(cores=core_sets)
def test_core_lists_read_back_as_written(cores: set[int]) -> None:
    assert parse_cores(cores_text(cores)) == tuple(sorted(cores))


@settings(deadline=None)
@given(cores=core_sets, replicas=st.integers(1, 12))
def test_the_split_gives_each_engine_its_own_cores_and_the_rest_one(
    cores: set[int], replicas: int
) -> None:
    if len(cores) < replicas + 1:
        with pytest.raises(LayoutError, match=f"need {replicas + 1} cores"):
            split_cores(sorted(cores), replicas)
        return
    layout = split_cores(sorted(cores), replicas)
    taken = [c for engine in layout.engines for c in engine]
    assert len(layout.engines) == replicas and all(layout.engines)
    assert len(taken) == len(set(taken)), "no core in two engines"
    assert sorted([*taken, *layout.rest]) == sorted(cores), "every core placed once"
    assert layout.rest == (min(cores),)
    sizes = [len(engine) for engine in layout.engines]
    assert max(sizes) - min(sizes) <= 1


def test_two_replicas_on_two_cores_are_refused_saying_why() -> None:
    with pytest.raises(LayoutError) as refused:
        split_cores([0, 1], 2)
    message = str(refused.value)
    assert message.startswith("2 vLLM engine replicas need 3 cores")
    assert "run --replicas 1 here, or give --cpu-layout" in message and "\n" not in message
    one = split_cores([0, 1], 1)
    assert one.engines == ((1,),) and one.rest == (0,)
    assert one.text() == "engine replica 0 computes on core 1; loader and layers on core 0 (auto)"
    assert one.engine_env(0) == {BIND_VARIABLE: "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("1|2", "expected ENGINES/REST"),
        ("1/0", "names 1 engine core lists for 2"),
        ("1|/0", "every engine replica needs a core"),
        ("1|1/0", "a core is in two engines' lists"),
        ("1|9/0", "core(s) 9 are not among the cores"),
        ("1|x/0", "'x' is not a core"),
    ],
)
def test_a_given_layout_is_checked(text: str, says: str) -> None:
    with pytest.raises(LayoutError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text, 2, [0, 1, 2, 3])


def test_a_given_layout_may_leave_the_rest_to_run_anywhere() -> None:
    layout = parse_layout("0|1/", 2, [0, 1])
    assert layout.rest == () and layout.source == "--cpu-layout"
    assert layout.text().endswith("loader and layers on any core (--cpu-layout)")
    assert CpuLayout.from_config(layout.to_data() | {"engines": [[0], [1]], "rest": []}) == layout


def test_run_json_config_reads_back_as_the_layout_text() -> None:
    from dataclasses import asdict

    import orjson

    layout = split_cores([0, 1, 2], 2)
    config = orjson.loads(orjson.dumps({"cpu_layout": asdict(layout)}))
    assert layout_text(config) == layout.text()
    assert layout_text({}) == "none (no engine compute to place)"


def _child_affinity(variable: str) -> tuple[set[int], str]:
    """The affinity and the value of ``variable`` a child process started now finds."""
    code = "import os, sys; print(*sorted(os.sched_getaffinity(0))); print(os.environ[sys.argv[1]])"
    out = subprocess.run(
        [sys.executable, "-c", code, variable], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return {int(c) for c in out[0].split()}, out[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_an_engine_started_in_the_block_binds_its_compute_to_the_engines_cores() -> None:
    before = os.sched_getaffinity(0)
    layout = split_cores(sorted(before), 1)
    with engine_cores(layout):
        affinity, bind = _child_affinity(BIND_VARIABLE)
    assert bind == cores_text(layout.engines[0]), "vLLM reads its OpenMP binding from here"
    assert affinity == before, "the processes themselves are not confined to the engine's cores"
    assert os.sched_getaffinity(0) == before and BIND_VARIABLE not in os.environ


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_front_ends_threads_move_to_the_rest_and_its_children_stay() -> None:
    code = (
        "import subprocess, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(child.pid, flush=True); time.sleep(30)\n"
    )
    cores = sorted(os.sched_getaffinity(0))
    layout = split_cores(cores, 1)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        time.sleep(0.2)  # its thread has started
        pin_threads(proc.pid, layout.rest)
        threads = cpus.thread_ids(proc.pid)
        assert len(threads) >= 2
        assert all(os.sched_getaffinity(t) == set(layout.rest) for t in threads)
        assert os.sched_getaffinity(child) == set(cores), "its children keep theirs"
    finally:
        os.kill(child, 9)
        proc.kill()
        proc.wait()
    assert cpus.thread_ids(proc.pid) == [], "a process that is gone has no threads to pin"
    pin_threads(proc.pid, layout.rest)  # and pinning it is no error


def test_run_and_wait_times_come_from_the_kernel() -> None:
    ran, waited = cpus.run_times([os.getpid()])
    assert ran > 0 and waited >= 0
    assert cpus.run_times([2**22 + 12345]) == (0, 0), "a process that is gone adds nothing"
