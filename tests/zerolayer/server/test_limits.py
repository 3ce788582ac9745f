"""The replica's limits: one config, its overrides and its documentation; the request-level
bounds the replica applies on the headers (request id) and the body (model name)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.engine import NullEngine
from tests.support.paths import DOCS
from tests.support.server_client import H2Client, run, wait_all
from zerolayer.server import start_replica
from zerolayer.server.limits import DEFAULT_LIMITS, FD_HEADROOM, Limits, markdown_table

LIMITS_DOC = DOCS / "limits.md"


def test_the_docs_table_is_the_config() -> None:
    """docs/limits.md carries the table rendered from the dataclass, defaults and all."""
    assert markdown_table() in LIMITS_DOC.read_text(encoding="utf-8")


def test_every_limit_says_what_it_bounds_and_whose_precedent_it_follows() -> None:
    for spec in dataclasses.fields(Limits):
        assert spec.metadata["doc"] and spec.metadata["precedent"], spec.name


@given(
    name=st.sampled_from([f.name for f in dataclasses.fields(Limits)]),
    value=st.integers(min_value=0, max_value=1 << 30),
)
def test_an_override_changes_that_limit_only(name: str, value: int) -> None:
    changed = DEFAULT_LIMITS.with_overrides({name.replace("_", "-"): str(value)})
    assert getattr(changed, name) == value
    for spec in dataclasses.fields(Limits):
        if spec.name != name:
            assert getattr(changed, spec.name) == getattr(DEFAULT_LIMITS, spec.name)


@pytest.mark.parametrize(
    "override,message",
    [
        ({"no_such": "1"}, "unknown limit 'no_such'"),
        ({"max_frame_size": "1.5"}, "expected an integer"),
        ({"send_stall_s": "soon"}, "expected a number"),
        ({"send_stall_s": "-1"}, "must be >= 0"),
        ({"send_stall_s": "nan"}, "must be >= 0"),
    ],
)
def test_a_bad_override_names_the_limit(override: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DEFAULT_LIMITS.with_overrides(override)


def test_the_connection_cap_stays_under_the_fd_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = DEFAULT_LIMITS.connection_cap()
    if soft != resource.RLIM_INFINITY:
        assert cap == max(1, soft - FD_HEADROOM) < soft
    assert Limits(max_connections=7).connection_cap() == 7


@pytest.mark.parametrize(
    "argument,message",
    [("--limit=nope", "expected NAME=VALUE"), ("--limit=bogus=1", "unknown limit 'bogus'")],
)
def test_zl_replica_refuses_a_bad_limit_in_one_line(argument: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerolayer.server", "--port", "0", argument],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zl-replica: error:") and message in lines[0]


@run
async def test_a_request_id_over_the_limit_is_refused_and_not_kept() -> None:
    """An oversize zl-request-id costs the client a few bytes over HPACK's table and the replica
    its length in the accounting ring: refused at the limit, never recorded."""
    limits = Limits(max_request_id_bytes=32)
    async with await start_replica(NullEngine(), limits=limits) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        fits = client.completion("hi", headers=[("zl-request-id", "r" * 32)])
        too_long = client.completion("hi", headers=[("zl-request-id", "r" * 33)])
        await wait_all([fits, too_long])
        assert fits.status == 200
        assert too_long.status == 400 and too_long.error == "bad_request"
        assert b"longer than 32 bytes" in too_long.data
        ids = [row["request_id"] for row in replica.replica.accounting.rows()]
        assert "r" * 32 in ids and all(len(rid) <= 32 for rid in ids)
        await client.close()


@run
async def test_an_unknown_model_is_refused_and_the_served_one_answered() -> None:
    async with await start_replica(NullEngine()) as replica:
        served = replica.replica.model
        client = await H2Client.connect("127.0.0.1", replica.port)
        known = client.completion("hi", model=served)
        unnamed = client.completion("hi")
        unknown = client.completion("hi", model="gpt-17")
        await wait_all([known, unnamed, unknown])
        assert known.status == unnamed.status == 200
        assert known.json()["model"] == served
        assert unknown.status == 404 and unknown.error == "model_not_found"
        assert b"gpt-17" in unknown.data
        await client.close()
