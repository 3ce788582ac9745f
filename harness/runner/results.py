"""A run's results directory: run.json (what was asked, on what, and how it ended) and
summary.json, both rewritten as they change, so a run cut short still leaves them whole.

Under ``--auth`` the directory also holds the key file the stacks start with: one fresh key per
tenant the profiles send as, each allowed the most urgent class that tenant is sent with.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import orjson
import psutil

from harness import schema
from harness.profile import Profile
from harness.runner.config import RunConfig
from harness.runner.priority import loader_nice
from harness.schema import Machine, RunEnd, RunMeta, SummaryRow, SweepSection
from harness.stacks import Credentials
from harness.telemetry import cpu_speed
from serving.auth import write_key_file
from serving.engine.tokenrules import BYTES_RULE, TokenRule
from serving.wire.contract import PRIORITIES

KEY_FILE = "api-keys.toml"
PACKAGES = ("h2", "h11", "hpack", "uvloop", "ray", "chaostoolkit-lib", "locust", "k6", "numpy")


def tenant_classes(profiles: Sequence[Profile]) -> dict[str, str]:
    """Each tenant the profiles send as, with the most urgent class it is sent with: the grant
    of its key under ``--auth`` (every tenant of a profile sends every class of that profile)."""
    grants: dict[str, str] = {}
    for profile in profiles:
        for tenant in profile.tenants:
            sent = [c.priority for c in profile.classes] + [grants.get(tenant, "low")]
            grants[tenant] = min(sent, key=PRIORITIES.__getitem__)
    return grants


def make_credentials(profiles: Sequence[Profile], folder: Path) -> Credentials:
    """A key file in ``folder`` with a fresh key per tenant of ``profiles`` (``--auth``)."""
    path = folder / KEY_FILE
    return Credentials(path, write_key_file(path, tenant_classes(profiles)))


def _git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, check=False, cwd=here
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _machine() -> Machine:
    """The host, with one core's speed (``cpu_speed``) as the run starts; the run's end adds
    ``cpu_speed_end``."""
    return Machine(
        hostname=platform.node(),
        platform=platform.platform(),
        cpus=os.cpu_count(),
        memory_bytes=psutil.virtual_memory().total,
        cpu_speed_start=round(cpu_speed()),
    )


class RunDir:
    """The results directory: run.json rewritten at every change of state, summary.json after
    every row and every sweep point. ``rule`` is the run's token rule (``choose_token_rule``):
    every schedule is built with it, and run.json records its name as ``token_rule``."""

    def __init__(self, config: RunConfig, kind: str = "", rule: TokenRule = BYTES_RULE) -> None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{config.scale}" + (f"-{kind}" if kind else "")
        self.path = Path(config.out) / run_id
        self.path.mkdir(parents=True, exist_ok=False)
        self.rule = rule
        self.summary: list[SummaryRow] = []
        self.sweep: SweepSection | None = None
        # --auth: the key file in this directory and each tenant's key (see the module docstring)
        self.credentials: Credentials | None = None
        self.meta = RunMeta(
            run_id=run_id,
            scale=config.scale,
            config=orjson.loads(orjson.dumps(asdict(config), default=str)),
            engine=config.engine,
            engine_options=dict(config.engine_options),
            git_revision=_git_revision(),
            versions=_versions(),
            machine=_machine(),
            started_ns=time.time_ns(),
            other={"token_rule": rule.name},
        )
        self.save()

    def save(self) -> None:
        schema.write_run_meta(self.path, self.meta)

    def add_summary(self, row: SummaryRow) -> None:
        self.summary.append(row)
        self.meta.validity[f"{row.stack}/{row.profile}"] = row.validity
        schema.write_summary(self.path, self.summary, self.sweep)
        self.save()

    def save_sweep(self) -> None:
        """summary.json with the sweep section as it stands (after every point)."""
        schema.write_summary(self.path, self.summary, self.sweep)

    def finish(self, end: RunEnd, detail: str = "") -> None:
        self.meta.end, self.meta.end_detail = end, detail
        self.meta.finished_ns = time.time_ns()
        self.meta.machine.cpu_speed_end = round(cpu_speed())
        self.save()


def open_run(
    config: RunConfig, profiles: Sequence[Profile], rule: TokenRule, kind: str = ""
) -> RunDir:
    """The results directory of a run about to start, with its key file under ``--auth`` and
    the niceness its loader will run at."""
    run = RunDir(config, kind=kind, rule=rule)
    if config.auth:
        run.credentials = make_credentials(profiles, run.path)
    run.meta.loader_nice = loader_nice()
    return run


def host_line(run: RunDir) -> str:
    """The host in a few words: cores and one core's speed (``cpu_speed``) as the run starts."""
    machine = run.meta.machine
    return (
        f"host: {machine.cpus} CPUs, one core at {machine.cpu_speed_start or 0:,} SHA-256 digests/s"
    )
