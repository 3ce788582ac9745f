"""Load profiles: one TOML file each in ``harness/profiles/``, at three scales.

The scales are ``smoke``, ``laptop`` and ``seed``. A profile fixes the request shapes (classes
with prompt size and output length), the arrival process, its SLOs (``[slo]``: a bound on a
percentile, e.g. ``ttft_p99_ms = 500``; a scale may override them) and, per scale, the rate,
duration, connection count and a sweep's budget (``sweep_duration_s`` per point, and
``sweep_repeats`` per rate). ``[workload]`` (a scale may override it under
``[scales.X.workload]``) chooses where requests come from: the classes (synthetic), a ShareGPT
or trace file, or generated multi-turn sessions (``WorkloadSpec``). A scale may set its own
session count (``sessions``); profile D carries ``[chaos]`` settings, profile G
``[elasticity]`` (``harness.elastic_settings``).
Both stacks run the same profile, so everything that defines a run's load lives here and is
validated strictly: an unknown key is an error, not a silently ignored typo.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, TypeVar

from harness.elastic_settings import ElasticSettings
from harness.metrics import Slo, parse_slo
from serving.wire.contract import MAX_DEADLINE_MS, MAX_OUTPUT_TOKENS, PRIORITIES
from serving.wire.tokens import BYTES_PER_TOKEN

PROFILE_DIR: Final = Path(__file__).parent / "profiles"
PROFILES: Final = (
    "a_latency",
    "b_high_concurrency",
    "c_mixed",
    "d_fault",
    "e_multi_turn",
    "f_shared_prefix",
    "g_elasticity",
)
# What ``zl-bench run`` (and ``nox -s bench``) runs when no profile is named: all but G, whose
# replica changes on both stacks, three trials each, would not fit the 15-minute laptop run.
DEFAULT_PROFILES: Final = PROFILES[:6]
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
SCALES: Final = ("smoke", "laptop", "seed")
DEFAULT_SCALE: Final = "laptop"
ARRIVALS: Final = ("constant", "poisson", "gamma")

_TOP_KEYS = {
    "name",
    "title",
    "description",
    "extends",
    "arrival",
    "defaults",
    "classes",
    "scales",
    "fault",
    "chaos",
    "elasticity",
    "slo",
    "workload",
}
_CLASS_KEYS = {
    "name",
    "weight",
    "prompt_bytes",
    "prompt_tokens",
    "max_tokens",
    "priority",
    "deadline_ms",
}
_SCALE_KEYS = {
    "rate",
    "duration_s",
    "max_requests",
    "connections",
    "classes",
    "fault",
    "seed",
    "chaos",
    "slo",
    "sweep_duration_s",
    "sweep_repeats",
    "workload",
    "elasticity",
    "sessions",
}
DEFAULT_SWEEP_DURATION_S: Final = 10.0
DEFAULT_SWEEP_REPEATS: Final = 3


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request: its prompt size (bytes; tokens are bytes / 4) and output length."""

    name: str
    weight: float
    prompt_bytes: int
    max_tokens: int
    priority: str
    deadline_ms: int

    @property
    def prompt_tokens(self) -> int:
        return max(1, math.ceil(self.prompt_bytes / BYTES_PER_TOKEN))


class WorkloadSource(StrEnum):
    """Where a profile's requests come from (``[workload] source``, or ``--workload``)."""

    SYNTHETIC = "synthetic"  # the classes' sizes, independent prompts (the default)
    SHAREGPT = "sharegpt"  # conversations from a ShareGPT-format file, replayed as sessions
    TRACE = "trace"  # arrival offsets and lengths from a trace file, at its own timing
    SESSIONS = "sessions"  # generated multi-turn sessions over shared per-tenant prefixes


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A profile's workload source and its settings (``[workload]`` in the TOML).

    ``path``: the ShareGPT or trace file (relative paths resolve against the repository root).
    ``time_scale``: a trace's offsets are multiplied by it (0.5 replays twice as fast).
    ``max_turns``: turns used per conversation or generated session (ShareGPT's default 1 is
    ``vllm bench serve``'s: the first human turn as prompt, the first reply's length as output).
    ``think_s``: mean think time between a session's turns (exponential, seeded), measured from
    one turn's send to the next. ``prefix_tokens``: the shared prefix (system prompt, tool
    definitions) every session of one prefix group starts with; ``prefix_groups``: how many
    distinct prefixes (one per tenant when 0). ``message_tokens``: each new user message (the
    session's class's ``prompt_tokens`` when 0).
    """

    source: WorkloadSource = WorkloadSource.SYNTHETIC
    path: str = ""
    time_scale: float = 1.0
    max_turns: int = 1
    think_s: float = 0.0
    prefix_tokens: int = 0
    prefix_groups: int = 0
    message_tokens: int = 0


_WORKLOAD_KEYS: Final = {
    "source",
    "path",
    "time_scale",
    "max_turns",
    "think_s",
    "prefix_tokens",
    "prefix_groups",
    "message_tokens",
}
FILE_SOURCES: Final = (WorkloadSource.SHAREGPT, WorkloadSource.TRACE)


def workload_path(path: str) -> Path:
    """A workload file's path: absolute as given, relative against the repository root."""
    given = Path(path).expanduser()
    return given if given.is_absolute() else REPO_ROOT / given


def _count(where: str, value: Any, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where} must be an integer of at least {least}, got {value!r}")
    return value


def _seconds(where: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where} must be a number of at least 0, got {value!r}")
    return float(value)


def check_workload(where: str, spec: WorkloadSpec) -> WorkloadSpec:
    """Raise ``ValueError`` (one line) when a file source has no path or its file is missing."""
    if spec.source in FILE_SOURCES:
        if not spec.path:
            raise ValueError(f"{where}: source {spec.source.value!r} needs a path")
        if not workload_path(spec.path).is_file():
            raise ValueError(f"{where}: no such workload file: {workload_path(spec.path)}")
    return spec


def parse_workload(where: str, raw: dict[str, Any]) -> WorkloadSpec:
    """``[workload]``: the source and its settings, validated as strictly as the rest."""
    _unknown(where, raw, set(_WORKLOAD_KEYS))
    source = raw.get("source", WorkloadSource.SYNTHETIC.value)
    if source not in {s.value for s in WorkloadSource}:
        choices = ", ".join(s.value for s in WorkloadSource)
        raise ValueError(f"{where}: source must be one of {choices}, got {source!r}")
    path = raw.get("path", "")
    if not isinstance(path, str):
        raise ValueError(f"{where}: path must be a string, got {path!r}")
    spec = WorkloadSpec(
        source=WorkloadSource(source),
        path=path,
        time_scale=_positive(f"{where} time_scale", raw.get("time_scale", 1.0)),
        max_turns=_count(f"{where} max_turns", raw.get("max_turns", 1), 1),
        think_s=_seconds(f"{where} think_s", raw.get("think_s", 0.0)),
        prefix_tokens=_count(f"{where} prefix_tokens", raw.get("prefix_tokens", 0), 0),
        prefix_groups=_count(f"{where} prefix_groups", raw.get("prefix_groups", 0), 0),
        message_tokens=_count(f"{where} message_tokens", raw.get("message_tokens", 0), 0),
    )
    return check_workload(where, spec)


@dataclass(frozen=True, slots=True)
class WorkloadChoice:
    """A command line's ``--workload``: the source, its file, and a trace's time scale (0 keeps
    the profile's)."""

    source: WorkloadSource
    path: str = ""
    time_scale: float = 0.0


WORKLOAD_OPTION_HELP: Final = (
    "replace every profile's workload source: synthetic, sessions (generated multi-turn "
    "sessions, the profile's [workload] settings), sharegpt:PATH (a ShareGPT-format JSON or "
    "JSONL file) or trace:PATH[@SCALE] (a Mooncake .jsonl or BurstGPT .csv trace; @0.5 replays "
    "it twice as fast); a relative path is from the current directory, else the repository "
    "root, e.g. "
    "sharegpt:harness/data/sharegpt_sample.json"
)


def parse_workload_option(text: str) -> WorkloadChoice:
    """``--workload``'s value (see ``WORKLOAD_OPTION_HELP``); a one-line ``ValueError``."""
    name, _, rest = text.partition(":")
    try:
        source = WorkloadSource(name.strip().lower())
    except ValueError:
        choices = "synthetic, sessions, sharegpt:PATH, trace:PATH[@SCALE]"
        raise ValueError(f"unknown workload {text!r}; choose from {choices}") from None
    if source not in FILE_SOURCES:
        if rest:
            raise ValueError(f"workload {source.value!r} takes no file, got {text!r}")
        return WorkloadChoice(source)
    time_scale = 0.0
    head, at, scale = rest.rpartition("@")
    if at and source is WorkloadSource.TRACE:
        try:
            time_scale = float(scale)
        except ValueError:
            raise ValueError(f"trace time scale must be a number, got {scale!r}") from None
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise ValueError(f"trace time scale must be positive, got {scale!r}")
        rest = head
    if not rest:
        raise ValueError(f"workload {source.value!r} needs a file: {source.value}:PATH")
    if Path(rest).expanduser().is_file():
        rest = str(Path(rest).expanduser().resolve())
    check_workload(f"{source.value}:{rest}", WorkloadSpec(source=source, path=rest))
    return WorkloadChoice(source, rest, time_scale)


@dataclass(frozen=True, slots=True)
class Fault:
    """The fault profile D runs, and when, in seconds from the start of the load."""

    kind: str
    start_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    """How long and how hard the chaos experiments of profile D run at one scale.

    The background load is the profile's own (rate, classes); ``deadline_ms`` replaces its
    deadline so that a request held through a fault and its recovery is answered, not lost.
    KV pressure's prompts ask for ``kv_fill`` times one engine replica's KV cache, in
    ``kv_requests`` requests of ``kv_max_tokens`` output each (prompts of ``kv_prompt_tokens``
    when the KV size is unknown), sent one after another over ``kv_ramp_s`` and held
    ``kv_hold_s`` from the first.
    """

    warmup_s: float
    tail_s: float
    settle_s: float
    window_s: float
    slo_ttft_ms: float
    sli_target: float
    deadline_ms: int
    recover_timeout_s: float
    pause_s: float
    load_max_s: float
    kv_hold_s: float
    kv_ramp_s: float
    kv_requests: int
    kv_fill: float
    kv_max_tokens: int
    kv_prompt_tokens: int
    health_interval_s: float
    health_timeout_s: float


Settings = TypeVar("Settings", ChaosSettings, ElasticSettings)


def _settings(cls: type[Settings], where: str, raw: dict[str, Any]) -> Settings:
    """A settings table (``[chaos]``, ``[elasticity]``) with the scale's overrides: every
    field of ``cls`` given, each a positive number of its type, an SLI target at most 1."""
    kinds = {f.name: int if f.type == "int" else float for f in fields(cls)}
    _unknown(where, raw, set(kinds))
    missing = set(kinds) - set(raw)
    if missing:
        raise ValueError(f"{where}: missing keys {sorted(missing)}")
    values = {k: _positive(f"{where} {k}", raw[k], kind) for k, kind in kinds.items()}
    if values["sli_target"] > 1:
        raise ValueError(f"{where} sli_target must be at most 1, got {values['sli_target']}")
    return cls(**values)


@dataclass(frozen=True, slots=True)
class Profile:
    """A profile at one scale: everything a loader needs to build and send the schedule."""

    name: str
    title: str
    description: str
    scale: str
    rate: float
    duration_s: float
    max_requests: int
    connections: int
    process: str
    burstiness: float
    classes: tuple[RequestClass, ...]
    sessions: int
    tenants: tuple[str, ...]
    seed: int
    fault: Fault | None = None
    chaos: ChaosSettings | None = None
    elasticity: ElasticSettings | None = None
    slos: tuple[Slo, ...] = ()
    sweep_duration_s: float = DEFAULT_SWEEP_DURATION_S
    sweep_repeats: int = DEFAULT_SWEEP_REPEATS
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)

    def as_dict(self) -> dict[str, Any]:
        """For run metadata: the exact load that was asked for."""
        return asdict(self)

    def at_rate(self, rate: float, seed: int | None = None) -> Profile:
        """This profile at another offered rate (and seed), for one point of a sweep: the
        point's duration is ``sweep_duration_s`` and the request count follows the rate."""
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        return replace(
            self,
            rate=rate,
            duration_s=self.sweep_duration_s,
            max_requests=max(1, math.ceil(rate * self.sweep_duration_s)),
            seed=self.seed if seed is None else seed,
        )

    def with_slos(self, slos: tuple[Slo, ...]) -> Profile:
        return replace(self, slos=slos)

    def with_workload(self, choice: WorkloadChoice) -> Profile:
        """This profile with another workload source (``--workload``): its file and time scale
        replaced where the choice gives them, the profile's other workload settings kept."""
        spec = replace(
            self.workload,
            source=choice.source,
            path=choice.path,
            time_scale=choice.time_scale or self.workload.time_scale,
        )
        return replace(self, workload=check_workload(f"{self.name} workload", spec))


def resolve_name(name: str) -> str:
    """Accept ``a_latency``, ``a``, ``A`` or a path stem; return the canonical profile name."""
    key = name.strip().lower()
    for full in PROFILES:
        if key in (full, full.split("_", 1)[0]):
            return full
    raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _unknown(where: str, got: dict[str, Any], allowed: set[str]) -> None:
    extra = set(got) - allowed
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")


def load_raw(source: str | Path) -> dict[str, Any]:
    """The TOML of a profile (by name or path), with ``extends`` resolved by a deep merge."""
    path = Path(source)
    if path.suffix != ".toml":
        path = PROFILE_DIR / f"{resolve_name(str(source))}.toml"
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"profile {path} does not read as TOML ({exc})") from None
    _unknown(str(path), raw, _TOP_KEYS)
    raw.setdefault("name", path.stem)  # a file of the user's own may leave it out
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ValueError(f"{path}: extends names a profile, got {parent!r}")
    base = load_raw(parent)
    for key in ("name", "title", "description"):
        base.pop(key, None)
    return _merge(base, raw)


def _positive(where: str, value: Any, kind: type = float) -> Any:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where} must be a positive number, got {value!r}")
    return kind(value)


def _request_class(raw: dict[str, Any], defaults: dict[str, Any]) -> RequestClass:
    name = raw.get("name", "")
    where = f"class {name!r}"
    _unknown(where, raw, _CLASS_KEYS)
    if ("prompt_bytes" in raw) == ("prompt_tokens" in raw):
        raise ValueError(f"{where}: give exactly one of prompt_bytes and prompt_tokens")
    prompt_bytes = (
        _positive(f"{where} prompt_bytes", raw["prompt_bytes"], int)
        if "prompt_bytes" in raw
        else _positive(f"{where} prompt_tokens", raw["prompt_tokens"], int) * BYTES_PER_TOKEN
    )
    max_tokens = _positive(f"{where} max_tokens", raw.get("max_tokens"), int)
    if max_tokens > MAX_OUTPUT_TOKENS:
        raise ValueError(f"{where}: max_tokens {max_tokens} > {MAX_OUTPUT_TOKENS}")
    priority = raw.get("priority", defaults.get("priority", "normal"))
    if priority not in PRIORITIES:
        raise ValueError(f"{where}: priority must be one of {sorted(PRIORITIES)}")
    deadline = _positive(
        f"{where} deadline_ms", raw.get("deadline_ms", defaults.get("deadline_ms", 30000)), int
    )
    if deadline > MAX_DEADLINE_MS:
        raise ValueError(f"{where}: deadline_ms {deadline} > {MAX_DEADLINE_MS}")
    return RequestClass(
        name=name or "default",
        weight=_positive(f"{where} weight", raw.get("weight", 1.0)),
        prompt_bytes=prompt_bytes,
        max_tokens=max_tokens,
        priority=priority,
        deadline_ms=deadline,
    )


def _slos(where: str, raw: dict[str, Any]) -> tuple[Slo, ...]:
    """``[slo]``: ``ttft_p99_ms = 500``-style entries, at most one per series."""
    slos = []
    for key, bound in raw.items():
        try:
            slos.append(parse_slo(key, bound))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    series = [s.series for s in slos]
    if len(set(series)) != len(series):
        raise ValueError(f"{where}: one SLO per series, got {sorted(raw)}")
    return tuple(slos)


def _scale_section(raw: dict[str, Any], scale: str) -> dict[str, Any]:
    """The profile's ``[scales.<scale>]`` table, checked for unknown keys."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {', '.join(SCALES)}")
    name = raw.get("name", "")
    scales = raw.get("scales", {})
    if scale not in scales:
        raise ValueError(f"profile {name!r} has no scale {scale!r}")
    sc: dict[str, Any] = scales[scale]
    _unknown(f"{name} scale {scale}", sc, _SCALE_KEYS)
    return sc


def _classes(raw: dict[str, Any], sc: dict[str, Any], scale: str) -> tuple[RequestClass, ...]:
    """The ``[[classes]]``, each with the scale's overrides applied (an override's prompt size,
    in bytes or tokens, replaces the class's either way)."""
    name = raw.get("name", "")
    overrides = sc.get("classes", {})
    raw_classes = raw.get("classes", [])
    if not raw_classes:
        raise ValueError(f"profile {name!r} has no [[classes]]")
    names = [c.get("name", "default") for c in raw_classes]
    if len(set(names)) != len(names):
        raise ValueError(f"profile {name!r}: class names repeat: {names}")
    missing = set(overrides) - set(names)
    if missing:
        raise ValueError(f"profile {name!r} scale {scale}: overrides unknown classes {missing}")
    classes = []
    for c in raw_classes:
        over = dict(overrides.get(c.get("name", "default"), {}))
        base = dict(c)
        if over.keys() & {"prompt_bytes", "prompt_tokens"}:
            base.pop("prompt_bytes", None)
            base.pop("prompt_tokens", None)
        classes.append(_request_class({**base, **over}, raw.get("defaults", {})))
    return tuple(classes)


def _arrival(raw: dict[str, Any]) -> dict[str, Any]:
    """``[arrival]``, checked: its process is one of ``ARRIVALS``."""
    arrival: dict[str, Any] = raw.get("arrival", {})
    _unknown(f"{raw.get('name', '')} arrival", arrival, {"process", "burstiness"})
    process = arrival.get("process", "constant")
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    return arrival


def _fault(raw: dict[str, Any], sc: dict[str, Any], scale: str, duration: float) -> Fault | None:
    """``[fault]`` with the scale's overrides; it must end before the load does."""
    if "fault" not in raw:
        return None
    name = raw.get("name", "")
    f = _merge(raw["fault"], sc.get("fault", {}))
    _unknown(f"{name} fault", f, {"kind", "start_s", "duration_s"})
    fault = Fault(
        kind=str(f["kind"]),
        start_s=float(f.get("start_s", 0.0)),
        duration_s=_positive(f"{name} fault duration_s", f.get("duration_s", 1.0)),
    )
    if fault.start_s + fault.duration_s > duration:
        raise ValueError(f"{name} {scale}: the fault ends after the load does")
    return fault


def _table(
    cls: type[Settings], key: str, raw: dict[str, Any], sc: dict[str, Any], where: str
) -> Settings | None:
    """The profile's ``[key]`` settings with the scale's over them; None without the table."""
    if key not in raw and key not in sc:
        return None
    return _settings(cls, f"{where} {key}", _merge(raw.get(key, {}), sc.get(key, {})))


def build(raw: dict[str, Any], scale: str = DEFAULT_SCALE, seed: int | None = None) -> Profile:
    """Validate a raw profile and resolve it at ``scale``; ``seed`` overrides the file's."""
    sc = _scale_section(raw, scale)
    name = raw.get("name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a profile's name must be a non-empty string, got {name!r}")
    defaults = raw.get("defaults", {})
    classes = _classes(raw, sc, scale)
    arrival = _arrival(raw)
    rate = _positive(f"{name} {scale} rate", sc.get("rate"))
    duration = _positive(f"{name} {scale} duration_s", sc.get("duration_s"))
    max_requests = _positive(
        f"{name} {scale} max_requests", sc.get("max_requests", math.ceil(rate * duration)), int
    )
    fault = _fault(raw, sc, scale, duration)
    tenants = defaults.get("tenants", ["default"])
    if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
        raise ValueError(f"{name} defaults.tenants must be a list of names, got {tenants!r}")
    slo_raw = sc.get("slo", raw.get("slo", {}))
    sweep_s = sc.get("sweep_duration_s", min(duration, DEFAULT_SWEEP_DURATION_S))
    return Profile(
        name=name,
        title=raw.get("title", name),
        description=raw.get("description", ""),
        scale=scale,
        rate=rate,
        duration_s=duration,
        max_requests=max_requests,
        connections=_positive(f"{name} {scale} connections", sc.get("connections", 64), int),
        process=arrival.get("process", "constant"),
        burstiness=_positive(f"{name} burstiness", arrival.get("burstiness", 1.0)),
        classes=classes,
        sessions=_positive(
            f"{name} sessions", sc.get("sessions", defaults.get("sessions", 64)), int
        ),
        tenants=tuple(str(t) for t in tenants) or ("default",),
        seed=int(seed if seed is not None else sc.get("seed", 0)),
        fault=fault,
        chaos=_table(ChaosSettings, "chaos", raw, sc, f"{name} {scale}"),
        elasticity=_table(ElasticSettings, "elasticity", raw, sc, f"{name} {scale}"),
        slos=_slos(f"{name} slo", slo_raw),
        sweep_duration_s=_positive(f"{name} {scale} sweep_duration_s", sweep_s),
        sweep_repeats=_positive(
            f"{name} {scale} sweep_repeats", sc.get("sweep_repeats", DEFAULT_SWEEP_REPEATS), int
        ),
        workload=parse_workload(
            f"{name} {scale} workload", _merge(raw.get("workload", {}), sc.get("workload", {}))
        ),
    )


def load_profile(
    source: str | Path, scale: str = DEFAULT_SCALE, seed: int | None = None
) -> Profile:
    """A profile by name (``a_latency``, ``a``) or TOML path, resolved at ``scale``."""
    return build(load_raw(source), scale, seed)
