"""Tenant authentication: the authorizer's every branch, the key file, and a real replica with it.

The acceptance case of issue 14 item 8: a flood labelled ``high`` by a client whose key allows only
``normal`` is refused with ``priority_not_allowed``, so another tenant's queued ``normal`` request
is served first and unharmed.
"""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.certs import self_signed
from serving.auth import (
    Authenticator,
    Grant,
    certificate_tenant,
    key_digest,
    key_file_text,
    load_key_file,
    parse_key_file,
    read_key_file,
    write_key_file,
)
from serving.engine import SimConfig, SimEngine
from serving.wire.contract import (
    PRIORITIES,
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_NORMAL,
    ContractError,
    RequestMeta,
)
from tests.support.server_client import H2Client, run, wait_all
from zerolayer.server import cli, start_replica

KEY_A = "key-of-tenant-a"
KEY_B = "key-of-tenant-b"
KEY_B2 = "second-key-of-b"
GRANTS = {
    key_digest(KEY_A): Grant("a", PRIORITY_NORMAL),
    key_digest(KEY_B): Grant("b", PRIORITY_LOW),
    key_digest(KEY_B2): Grant("b", PRIORITY_HIGH),
}
AUTH = Authenticator(GRANTS)
MODEL = "llama-3.2-1b"

printable = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40).filter(str.isprintable)
priorities = st.sampled_from([PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW])


def meta(tenant: str = "default", priority: int = PRIORITY_NORMAL) -> RequestMeta:
    return RequestMeta("", tenant, priority, 60_000, None, None)


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def refusal(tenant: str, priority: int, authorization: bytes | None, identity: str | None) -> str:
    with pytest.raises(ContractError) as caught:
        AUTH.authorize(meta(tenant, priority), authorization, identity)
    return caught.value.error.code


# -- authorize ------------------------------------------------------------------------------------


def test_a_request_without_credentials_is_unauthorized() -> None:
    assert refusal("default", PRIORITY_NORMAL, None, None) == "unauthorized"


@given(st.binary(max_size=80))
def test_any_key_not_in_the_file_is_refused(key: bytes) -> None:
    if key.strip() in (b.encode() for b in (KEY_A, KEY_B, KEY_B2)):
        return
    for header in (b"Bearer " + key, key):
        assert refusal("default", PRIORITY_LOW, header, None) == "unauthorized"


def test_only_the_bearer_scheme_is_read_and_its_name_is_case_insensitive() -> None:
    assert refusal("a", PRIORITY_NORMAL, f"Basic {KEY_A}".encode(), None) == "unauthorized"
    assert refusal("a", PRIORITY_NORMAL, KEY_A.encode(), None) == "unauthorized"
    for header in (f"bearer {KEY_A}", f"BEARER  {KEY_A} ", f" Bearer {KEY_A}"):
        assert AUTH.authorize(meta("a"), header.encode(), None).tenant == "a"


def test_a_request_naming_no_tenant_is_booked_to_its_keys() -> None:
    assert AUTH.authorize(meta(), bearer(KEY_A), None) == meta("a")


@given(priorities)
def test_a_tenant_header_equal_to_the_keys_always_passes_within_its_class(priority: int) -> None:
    for key, grant in ((KEY_A, GRANTS[key_digest(KEY_A)]), (KEY_B, GRANTS[key_digest(KEY_B)])):
        asked = meta(grant.tenant, max(priority, grant.highest))
        assert AUTH.authorize(asked, bearer(key), None) is asked


@given(printable)
def test_a_tenant_header_naming_another_tenant_is_refused(tenant: str) -> None:
    if tenant in ("a", "default"):
        return
    assert refusal(tenant, PRIORITY_LOW, bearer(KEY_A), None) == "tenant_mismatch"


@given(priorities)
def test_a_class_above_the_keys_is_refused_and_at_or_below_it_passes(priority: int) -> None:
    # KEY_A allows normal: high is refused, normal and low pass.
    if priority < PRIORITY_NORMAL:
        assert refusal("a", priority, bearer(KEY_A), None) == "priority_not_allowed"
    else:
        assert AUTH.authorize(meta("a", priority), bearer(KEY_A), None).priority == priority


def test_each_key_carries_its_own_class() -> None:
    assert refusal("b", PRIORITY_NORMAL, bearer(KEY_B), None) == "priority_not_allowed"
    assert AUTH.authorize(meta("b", PRIORITY_HIGH), bearer(KEY_B2), None).tenant == "b"


def test_a_certificate_stands_in_for_a_key_with_its_tenants_highest_class() -> None:
    assert AUTH.authorize(meta(), None, "a") == meta("a")
    assert AUTH.authorize(meta("b", PRIORITY_HIGH), None, "b").priority == PRIORITY_HIGH
    assert refusal("a", PRIORITY_HIGH, None, "a") == "priority_not_allowed"


def test_a_certificate_tenant_with_no_grant_is_unauthorized() -> None:
    assert refusal("default", PRIORITY_LOW, None, "stranger") == "unauthorized"


def test_a_certificate_and_a_tenant_header_must_agree() -> None:
    assert refusal("b", PRIORITY_LOW, None, "a") == "tenant_mismatch"


def test_a_key_beside_a_certificate_must_name_the_same_tenant() -> None:
    assert refusal("default", PRIORITY_LOW, bearer(KEY_B), "a") == "tenant_mismatch"
    # the same tenant: the key's own class applies (KEY_B allows only low)
    assert refusal("default", PRIORITY_NORMAL, bearer(KEY_B), "b") == "priority_not_allowed"
    # an unknown key beside a certificate is no key at all
    assert AUTH.authorize(meta(), bearer("nope"), "a") == meta("a")


# -- the key file ---------------------------------------------------------------------------------


def test_write_key_file_makes_fresh_keys_only_the_owner_can_read(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    keys = write_key_file(path, {"t0": "high", "t1": "low"})
    again = write_key_file(tmp_path / "other.toml", {"t0": "high"})
    assert keys["t0"] != again["t0"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert keys["t0"] not in text and key_digest(keys["t0"]) in text
    auth = load_key_file(path)
    assert auth.authorize(meta(priority=PRIORITY_HIGH), bearer(keys["t0"]), None).tenant == "t0"
    with pytest.raises(ContractError):
        auth.authorize(meta(priority=PRIORITY_NORMAL), bearer(keys["t1"]), None)


@given(st.dictionaries(printable, st.sampled_from(sorted(PRIORITIES)), min_size=1, max_size=4))
def test_any_printable_tenant_round_trips_through_the_file(tenants: dict[str, str]) -> None:
    grants = {key_digest(name): Grant(name, PRIORITIES[p]) for name, p in tenants.items()}
    assert parse_key_file(key_file_text(grants)) == grants


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("keys = [", "not TOML"),
        ("", "no keys"),
        ("[other]\nx = 1\n", "unknown tables"),
        ('[keys.abc]\ntenant = "t"\npriority = "low"\n', "64 lowercase hex"),
        (f'[keys.{"A" * 64}]\ntenant = "t"\npriority = "low"\n', "64 lowercase hex"),
        (f'[keys.{"a" * 64}]\ntenant = "t"\n', "exactly tenant and priority"),
        (f'[keys.{"a" * 64}]\ntenant = "t"\npriority = "low"\nx = 1\n', "exactly tenant"),
        (f'[keys.{"a" * 64}]\ntenant = ""\npriority = "low"\n', "tenant must be"),
        (f'[keys.{"a" * 64}]\ntenant = 3\npriority = "low"\n', "tenant must be"),
        (f'[keys.{"a" * 64}]\ntenant = "t"\npriority = "urgent"\n', "priority must be"),
    ],
)
def test_a_malformed_key_file_is_one_line_naming_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint) as caught:
        parse_key_file(text)
    assert "\n" not in str(caught.value)


def test_zl_replica_reports_a_bad_key_file_as_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "keys.toml"
    bad.write_text("[keys.nothex]\n")
    assert cli.main(["--api-keys", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("zl-replica: error: --api-keys:"), err
    with pytest.raises(SystemExit) as exited:
        cli.main(["--api-keys", str(tmp_path / "missing.toml")])
    assert exited.value.code == 2


def test_zl_replica_refuses_a_client_ca_without_a_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    assert cli.main(["--tls-client-ca", str(ca)]) == 2
    assert "--tls-client-ca needs --tls-cert and --api-keys" in capsys.readouterr().err
    cert_pem, key_pem = self_signed(tmp_path / "server")
    write_key_file(tmp_path / "keys.toml", {"a": "low"})
    tls = ["--tls-cert", str(cert_pem), "--tls-key", str(key_pem)]
    assert (
        cli.main([*tls, "--api-keys", str(tmp_path / "keys.toml"), "--tls-client-ca", str(ca)]) == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("zl-replica: error: cannot load --tls-client-ca"), (
        err
    )


# -- client certificates --------------------------------------------------------------------------


def cert(cn: str | None = None, *uris: str) -> dict[str, object]:
    """A ``getpeercert()`` dict with a subject commonName and URI subject alternative names."""
    subject = ((("organizationName", "zl"),),) + (((("commonName", cn),),) if cn else ())
    return {"subject": subject, "subjectAltName": tuple(("URI", u) for u in uris)}


def test_certificate_tenant_reads_the_uri_san_first_then_the_common_name() -> None:
    assert certificate_tenant(cert("host.example", "zl-tenant:acme")) == "acme"
    assert certificate_tenant(cert("acme")) == "acme"
    assert certificate_tenant(cert("acme", "spiffe://example/acme")) == "acme"


def test_certificate_tenant_is_none_when_the_certificate_is_ambiguous_or_silent() -> None:
    assert certificate_tenant(cert(None, "zl-tenant:a", "zl-tenant:b")) is None
    assert certificate_tenant(cert(None)) is None
    assert certificate_tenant(cert(None, "zl-tenant:")) is None
    assert certificate_tenant({}) is None
    assert certificate_tenant({"subject": "garbage", "subjectAltName": (("URI",),)}) is None


# -- a real replica -------------------------------------------------------------------------------


def replica_auth(tmp_path: Path) -> tuple[Authenticator, dict[str, str]]:
    path = tmp_path / "keys.toml"
    keys = write_key_file(path, {"a": "normal", "b": "normal"})
    return load_key_file(path), keys


def auth_header(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


@run
async def test_a_replica_with_keys_refuses_v1_without_one_and_keeps_health_open(
    tmp_path: Path,
) -> None:
    auth, keys = replica_auth(tmp_path)
    engine = SimEngine(SimConfig(model_shape=MODEL))
    async with await start_replica(engine, auth=auth) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        for path in ("/health", "/metrics"):
            assert (await client.get(path)).status == 200
        assert (await client.get("/v1/models")).error == "unauthorized"
        anonymous = client.completion("x", max_tokens=2)
        forged = client.completion("x", max_tokens=2, headers=[("authorization", "Bearer forged")])
        spoofed = client.completion(
            "x", max_tokens=2, headers=[auth_header(keys["a"]), ("zl-tenant", "b")]
        )
        good = client.completion("x", max_tokens=2, headers=[auth_header(keys["a"])])
        await wait_all([anonymous, forged, spoofed, good], 5)
        assert (anonymous.status, anonymous.error) == (401, "unauthorized")
        assert (forged.status, forged.error) == (401, "unauthorized")
        assert (spoofed.status, spoofed.error) == (403, "tenant_mismatch")
        assert good.status == 200
        models = client.request("/v1/models", method="GET", headers=[auth_header(keys["b"])])
        await wait_all([models], 5)
        assert models.status == 200
        await client.close()
        assert replica.replica.refusals["unauthorized"] == 3
    await engine.close()


@run
async def test_a_high_flood_from_a_normal_key_leaves_another_tenants_queued_request_first(
    tmp_path: Path,
) -> None:
    auth, keys = replica_auth(tmp_path)
    engine = SimEngine(SimConfig(model_shape=MODEL, max_num_seqs=1))
    async with await start_replica(engine, auth=auth) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        # Long enough (about a minute modelled) to hold the one slot however slow the host; reset.
        hog = client.completion(
            "hog", max_tokens=50_000, stream=True, headers=[auth_header(keys["b"])]
        )
        await asyncio.wait_for(hog.got_data.wait(), 5)
        queued = client.completion("mine", max_tokens=2, headers=[auth_header(keys["b"])])
        flood = [
            client.completion(f"f{i}", max_tokens=2,
                              headers=[auth_header(keys["a"]), ("zl-priority", "high")])
            for i in range(50)
        ]  # fmt: skip
        await wait_all(flood, 5)
        assert {(s.status, s.error) for s in flood} == {(403, "priority_not_allowed")}
        queue = replica.replica.queue
        assert len(queue) == 1 and queue.state.count[PRIORITY_HIGH] == 0
        client.reset(hog)
        await wait_all([queued], 5)
        assert queued.status == 200
        await client.close()
    await engine.close()


# -- the baseline's ingress (its request handler, without Ray: refusals never reach an engine) ----


def ingress_call(
    orchestrator: Any, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, str]:
    """One request through the Orchestrator's handler: its status and ``zl-error``."""
    from starlette.requests import Request

    scope = {
        "type": "http",
        "method": "POST" if body else "GET",
        "path": path,
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    response = asyncio.run(orchestrator(Request(scope, receive)))
    return response.status_code, response.headers.get("zl-error", "")


def test_the_baseline_ingress_checks_the_same_key_file_and_budgets_the_keys_tenant(
    tmp_path: Path,
) -> None:
    from baselines.rayserve.config import BaselineConfig, TenantBudget
    from baselines.rayserve.ingress import Orchestrator

    path = tmp_path / "keys.toml"
    keys = write_key_file(path, {"a": "normal"})
    config = BaselineConfig(
        api_keys=str(path), tenant_budgets={"a": TenantBudget(rate=1.0, burst=1.0)}
    )
    orchestrator = Orchestrator(cast(Any, None), config.ingress_settings())
    body = orjson.dumps({"prompt": "x", "max_tokens": 4})
    key = {"authorization": f"Bearer {keys['a']}"}
    completions = "/v1/completions"
    assert ingress_call(orchestrator, completions, {}, body) == (401, "unauthorized")
    assert ingress_call(orchestrator, "/v1/models", {}) == (401, "unauthorized")
    assert ingress_call(orchestrator, "/v1/models", key)[0] == 200
    assert ingress_call(orchestrator, completions, {**key, "zl-tenant": "b"}, body) == (
        403,
        "tenant_mismatch",
    )
    assert ingress_call(orchestrator, completions, {**key, "zl-priority": "high"}, body) == (
        403,
        "priority_not_allowed",
    )
    # No zl-tenant: the request is the key's tenant's, and spends tenant a's (tiny) budget.
    assert ingress_call(orchestrator, completions, key, body) == (429, "budget_exceeded")


# -- the bench's production-like mode (--auth) ----------------------------------------------------


@pytest.mark.parametrize("loader", ["native", "k6", "locust"])
def test_every_loader_sends_each_tenants_own_key(tmp_path: Path, loader: str) -> None:
    """Every class is ``high``; the last tenant's key allows only ``normal``: its requests, and
    only its, are refused, so each request carried its own tenant's key."""
    from harness.loaders import loader_with, needs_tls
    from harness.loaders.k6 import K6Loader
    from harness.loaders.native import NativeLoader
    from harness.stacks import Credentials, StackName, StackSpec, stand_up
    from harness.workload import build_schedule
    from tests.support.loader_checks import profile_at

    base = profile_at(rate=20.0, duration_s=1.0, max_tokens=2)
    profile = replace(base, classes=tuple(replace(c, priority="high") for c in base.classes))
    capped = profile.tenants[-1]
    path = tmp_path / "keys.toml"
    grants = {tenant: "high" for tenant in profile.tenants} | {capped: "normal"}
    credentials = Credentials(path, write_key_file(path, grants))
    tls = needs_tls(loader, StackName.ZEROLAYER)
    spec = StackSpec(StackName.ZEROLAYER, replicas=1, tls=tls, credentials=credentials)
    schedule = build_schedule(profile)
    with stand_up(spec, tmp_path / "stack") as stack:
        assert stack.metadata["auth"] == "api keys (keys.toml)"
        chosen = loader_with(loader, progress=None)
        if isinstance(chosen, K6Loader):
            # A VU per iteration: on a loaded host k6 skips an iteration when every VU is busy.
            chosen = replace(chosen, vus=len(schedule))
        elif isinstance(chosen, NativeLoader):
            # No health polling: a /health slow to answer on a loaded host is not what is judged.
            chosen = replace(chosen, client_options={"health_interval_s": 0})
        result = chosen.run(schedule, stack, profile, tmp_path / "req.jsonl", tmp_path / "work")
    assert {r.tenant for r in result.records} == set(profile.tenants)
    for rec in result.records:
        expected = ("error", "priority_not_allowed") if rec.tenant == capped else ("completed", "")
        assert (rec.outcome, rec.error_code or "") == expected, rec


def test_a_bench_run_with_auth_keys_every_tenant_and_records_it(tmp_path: Path) -> None:
    from bench import run as bench_run
    from harness import schema
    from harness.profile import load_profile
    from harness.runner.config import RunConfig
    from harness.runner.results import KEY_FILE
    from harness.stacks import StackName

    config = RunConfig(
        scale="smoke",
        profiles=("c_mixed",),
        stacks=(StackName.ZEROLAYER,),
        replicas=1,
        out=str(tmp_path),
        quiet=True,
        auth=True,
    )
    assert bench_run.run(config) == 0
    (run,) = [p for p in tmp_path.iterdir() if (p / schema.RUN_META).is_file()]
    meta = orjson.loads((run / schema.RUN_META).read_bytes())
    assert meta["config"]["auth"] is True
    assert meta["stacks"]["zerolayer"]["auth"] == f"api keys ({KEY_FILE})"
    profile = load_profile("c_mixed", "smoke")
    grants = read_key_file(run / KEY_FILE).values()
    assert {g.tenant: g.highest for g in grants} == dict.fromkeys(profile.tenants, PRIORITY_HIGH)
    records = schema.read_requests(run / schema.requests_file("zerolayer", "c_mixed"))
    refused = {"unauthorized", "tenant_mismatch", "priority_not_allowed"}
    assert records and not [r for r in records if r.error_code in refused]
    assert {r.priority for r in records if r.outcome == "completed"} >= {"high", "low"}


def test_auth_is_refused_for_stacks_the_run_did_not_start() -> None:
    from harness.errors import UsageError
    from harness.runner.config import RunConfig, check_external

    config = RunConfig(baseline_url="http://127.0.0.1:9", auth=True)
    with pytest.raises(UsageError, match="--auth"):
        check_external(config)


# -- the overhead benchmark's --auth ---------------------------------------------------------------


def overhead_level(target: str, e2el_p50: float, cpu_s: float, repeat: int = 0) -> Any:
    from bench.overhead.model import HostLoad, Level, ServerCpu

    return Level(
        target=target, in_flight=1, rate=5.0, completed=10, errors=0, ttft_p50_ms=1.0,
        ttft_p99_ms=2.0, e2el_p50_ms=e2el_p50, e2el_p99_ms=2 * e2el_p50, lag_p99_ms=0.1,
        tokens=(8,) * 10, client_cpu_us=1.0, server_cpu=ServerCpu(cpu_s, cpu_s),
        host=HostLoad(busy=0.1, load1=0.1, cores=2), repeat=repeat,
    )  # fmt: skip


def test_overhead_reports_each_stack_with_auth_against_itself_without() -> None:
    from bench.overhead.render import auth_costs

    levels = [
        level
        for repeat in range(3)
        for level in (
            overhead_level("inproc", 1.0, 0.0, repeat),
            overhead_level("zerolayer", 2.0 + 0.1 * repeat, 0.010, repeat),
            overhead_level("zerolayer+auth", 2.5 + 0.1 * repeat, 0.012, repeat),
        )
    ]
    (line,) = auth_costs(levels)
    assert line.startswith("auth cost, zerolayer at 1 in flight: E2EL p50 +0.50 [+0.50, +0.50] ms")
    assert "p99 +1.00 [+1.00, +1.00] ms (n=3)" in line
    assert "server CPU +200.0 [+200.0, +200.0] us (n=3) per request" in line
    assert auth_costs(levels[:2]) == []


def test_overhead_auth_adds_a_run_after_each_stack_that_checks_keys() -> None:
    import argparse

    from bench.overhead import add_arguments
    from bench.overhead.cli import resolve
    from bench.overhead.measure import authorize_us
    from bench.overhead.targets import choose_targets
    from harness.errors import UsageError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chosen = choose_targets(resolve(parser.parse_args(["--auth", "--targets", "inproc,zerolayer"])))
    assert [kind.name for kind in chosen] == ["inproc", "zerolayer", "zerolayer+auth"]
    plain = choose_targets(resolve(parser.parse_args(["--targets", "inproc,zerolayer"])))
    assert [kind.name for kind in plain] == ["inproc", "zerolayer"]
    with pytest.raises(UsageError, match="--auth needs a target"):
        choose_targets(resolve(parser.parse_args(["--auth", "--targets", "inproc"])))
    assert authorize_us(calls=1000) > 0
