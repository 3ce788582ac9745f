"""Profile D under ``zl-bench run --auth``: a real chaos experiment on a zero-layer stack whose
replicas check API keys, so the background load, the actions and a restarted replica all use them.
"""

from __future__ import annotations

import http.client
from pathlib import Path

from chaos.targets import read_target
from harness.profile import load_profile
from harness.runner.results import make_credentials
from harness.schema import read_requests, requests_file
from harness.stacks import StackName
from tests.support.chaos_checks import run_and_check, stack_under_chaos
from zerolayer.client.sdk import split_url

EXPERIMENT = "kill-engine-replica"
REFUSED = frozenset({"unauthorized", "tenant_mismatch", "priority_not_allowed"})


def models_status(url: str, key: str | None) -> int:
    """``GET /v1/models`` over HTTP/1.1, with ``key`` as a bearer token when given."""
    host, port, _ = split_url(url)
    conn = http.client.HTTPConnection(host, port, timeout=5.0)
    try:
        conn.request("GET", "/v1/models", headers={"authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_replica_kill_under_auth_sends_every_key_and_restarts_with_the_key_file(
    tmp_path: Path,
) -> None:
    """No request of the load is refused for its credentials, and the killed replica comes back
    with the run's key file: it refuses a request without a key and serves the default key's."""
    credentials = make_credentials([load_profile("d_fault", "smoke")], tmp_path)
    out_dir = tmp_path / "out"
    with stack_under_chaos(StackName.ZEROLAYER, tmp_path / "stack", credentials) as running:
        stack, target_file, profile = running
        before = read_target(target_file)
        assert before.api_keys == dict(credentials.keys)
        assert not [key for key in credentials.keys.values() if key in repr(before)]

        row = run_and_check(target_file, out_dir, stack, profile, EXPERIMENT)
        pairs = zip(before.replicas, read_target(target_file).replicas, strict=True)
        (restarted,) = [after for old, after in pairs if old.pid != after.pid]
        assert models_status(restarted.url, None) == 401
        assert models_status(restarted.url, credentials.default_key) == 200

    records = read_requests(out_dir / "chaos" / requests_file("zerolayer", f"d_fault-{EXPERIMENT}"))
    assert {r.tenant for r in records} == set(credentials.keys)
    assert not [(r.tenant, r.error_code) for r in records if r.error_code in REFUSED]
    assert row.fault == "kill" and row.completed > 0
    assert row.sdk_reroute_s is not None
    flag = restarted.command.index("--api-keys")
    assert restarted.command[flag + 1] == str(credentials.key_file)
