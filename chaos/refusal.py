"""Refusal speed under rising KV pressure, per request and per stack (docs/design.md, "Chaos").

The KV-pressure action (``chaos.actions.kv_pressure``) sends its requests, all of one shape
(``prompt + max_tokens`` tokens), to one replica one after another over a ramp, and logs each as
a ``RequestRecord`` (``refusals-<stack>-<experiment>[.r<k>].jsonl``). The engines' hosts stamp
their KV under pressure (``serving.engine.kvwatch``). From the two, for one run of the
experiment on one stack (a trial):

- **refusal latency**, per refused request: ``refused_ns - sent_ns``, from the send to the moment
  the client saw the refusal (its error status, or the stream's reset), in whole microseconds;
  p50 and p99 over the trial's refused requests;
- **threshold crossing**: the first watch sample in the pressure's window at which the replica's
  committed KV (``KvSample.committed``) plus one pressure request's blocks passes the embedded
  scheduler's refusal watermark for its class (``REFUSAL_WATERMARK``, normal priority): from
  then on the zero-layer scheduler refuses every request of the pressure's shape, and the
  replica is full for it on either stack. The replica is the one whose watch went highest in
  the window (the one the pressure was pinned to);
- **notice time**: from the crossing to the first refusal any pressure request's client saw;
  when none came before the pressure ended it is *censored*: the figure is the time to the end
  of the pressure, a lower bound;
- **admitted after the threshold**: the requests the full replica's host took in (its watch's
  ``admitted``) after the crossing and before the first refusal (or the pressure's end): each
  was let into a replica already full for a request of the pressure's shape.

A stack without a watch (Ray Serve LLM, whose engines are Ray's) has latencies but no crossing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np

from harness.curves import interval
from harness.schema import RequestRecord
from harness.tables import Align, Column, fmt, text_table
from serving.engine.kv import blocks_for
from serving.engine.kvwatch import FILE_PREFIX, KvSample, read_kv_watch
from serving.wire.contract import PRIORITY_NORMAL
from zerolayer.scheduler import SchedulerConfig

_WATERMARKS = SchedulerConfig().kv_watermarks
assert _WATERMARKS is not None
REFUSAL_WATERMARK: Final = _WATERMARKS[PRIORITY_NORMAL]
NS_PER_US: Final = 1_000
NS_PER_MS: Final = 1_000_000
CUT: Final = "cancelled_at_end"
"""The error code of a pressure request still running when the pressure ended (it was cut)."""


@dataclass
class RefusalTrial:
    """One KV-pressure run on one stack, as the module docstring defines its figures.

    ``latencies_us``: each refused request's refusal latency; ``codes``: how they were refused;
    ``crossing_ns``/``first_refusal_ns``: 0 when there was none; ``notice_ms`` None without a
    crossing, a lower bound when ``censored``; ``admitted_after`` None without a crossing;
    ``watched``: the watch file the crossing was read from; ``note``: what is missing and why;
    ``gap_ms``: the ramp's planned time between sends, ``send_lag_p99_ms`` how late they went.
    """

    requests: int = 0
    refused: int = 0
    latencies_us: list[int] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    p50_ms: float | None = None
    p99_ms: float | None = None
    reserve_blocks: int = 0
    watermark: float = REFUSAL_WATERMARK
    crossing_ns: int = 0
    first_refusal_ns: int = 0
    notice_ms: float | None = None
    censored: bool = False
    admitted_after: int | None = None
    watched: str = ""
    note: str = ""
    gap_ms: float = 0.0
    send_lag_p99_ms: float | None = None

    def problems(self) -> list[str]:
        """Why this trial cannot say how fast the stack refused: the replica never became
        full (or nobody watched it), or the pressure's sends did not keep to their ramp."""
        out = [self.note] if not self.crossing_ns else []
        lag = self.send_lag_p99_ms
        if lag is not None and lag > self.gap_ms:
            out.append(f"the pressure's sends lagged (p99 {lag:.1f} ms > its {self.gap_ms:.1f} "
                       "ms between sends)")  # fmt: skip
        return out


def refused(rec: RequestRecord) -> bool:
    """Refused: ended in an error before any output, with the moment the client saw it."""
    return rec.outcome == "error" and rec.refused_ns > 0 and not rec.first_token_ns


def latency_us(rec: RequestRecord) -> int:
    return (rec.refused_ns - rec.sent_ns) // NS_PER_US


def _percentile_ms(values_us: Sequence[int], q: float) -> float | None:
    return float(np.percentile(values_us, q)) / 1000.0 if values_us else None


def _send_lag_p99_ms(records: Sequence[RequestRecord]) -> float | None:
    lags = [r.sent_ns - r.intended_start_ns for r in records if r.sent_ns]
    return float(np.percentile(lags, 99)) / NS_PER_MS if lags else None


def read_watches(directory: str | Path) -> dict[str, list[KvSample]]:
    """Every KV watch file in ``directory``, by file name (none when it is not there)."""
    folder = Path(directory)
    if not str(directory) or not folder.is_dir():
        return {}
    return {p.name: read_kv_watch(p) for p in sorted(folder.glob(f"{FILE_PREFIX}*.jsonl"))}


def pressed(
    watches: Mapping[str, Sequence[KvSample]], start_ns: int, end_ns: int
) -> tuple[str, list[KvSample]] | None:
    """The watch whose committed KV went highest within ``[start_ns, end_ns]``, and its samples
    there; None when no watch recorded anything in the window."""
    best: tuple[float, str, list[KvSample]] | None = None
    for name, samples in watches.items():
        inside = [s for s in samples if start_ns <= s.t_ns <= end_ns]
        if inside:
            peak = max(s.committed_fraction for s in inside)
            if best is None or peak > best[0]:
                best = (peak, name, inside)
    return None if best is None else (best[1], best[2])


def crossing(
    samples: Sequence[KvSample], reserve_blocks: int, watermark: float = REFUSAL_WATERMARK
) -> KvSample | None:
    """The first sample at which one more request of ``reserve_blocks`` would pass
    ``watermark`` of the cache (the embedded scheduler's refusal condition)."""
    for s in samples:
        if s.total and (s.committed + reserve_blocks) / s.total > watermark:
            return s
    return None


def admitted_between(samples: Sequence[KvSample], cross: KvSample, until_ns: int) -> int:
    """Requests the host took in after the ``cross`` sample, up to ``until_ns``."""
    before = [s.admitted for s in samples if s.t_ns <= until_ns]
    return max(0, (before[-1] if before else cross.admitted) - cross.admitted)


def measure(
    records: Sequence[RequestRecord],
    watches: Mapping[str, Sequence[KvSample]],
    window: tuple[int, int],
    request_tokens: int,
    ramp_s: float = 0.0,
) -> RefusalTrial:
    """The trial's figures from the pressure's records and the stack's KV watches.

    ``window``: the pressure's (start_ns, end_ns); ``request_tokens``: one pressure request's
    ``prompt + max_tokens``; ``ramp_s``: how long its sends were spread over.
    """
    start_ns, end_ns = window
    hits = sorted((r for r in records if refused(r)), key=lambda r: r.refused_ns)
    latencies = [latency_us(r) for r in hits]
    trial = RefusalTrial(
        requests=len(records),
        refused=len(hits),
        latencies_us=latencies,
        codes=dict(Counter(r.error_code for r in hits)),
        p50_ms=_percentile_ms(latencies, 50),
        p99_ms=_percentile_ms(latencies, 99),
        first_refusal_ns=hits[0].refused_ns if hits else 0,
        gap_ms=1000.0 * ramp_s / max(1, len(records)),
        send_lag_p99_ms=_send_lag_p99_ms(records),
    )
    found = pressed(watches, start_ns, end_ns)
    if found is None:
        trial.note = "no KV watch recorded the pressure: the threshold crossing is not known"
        return trial
    trial.watched, samples = found
    trial.reserve_blocks = blocks_for(request_tokens, samples[0].block_size or 1)
    cross = crossing(samples, trial.reserve_blocks)
    if cross is None:
        peak = max(s.committed_fraction for s in samples)
        trial.note = f"the replica never became full for the pressure (peak {peak:.0%} committed)"
        return trial
    trial.crossing_ns = cross.t_ns
    until = trial.first_refusal_ns or end_ns
    trial.censored = not trial.first_refusal_ns
    trial.notice_ms = (until - cross.t_ns) / NS_PER_MS
    trial.admitted_after = admitted_between(samples, cross, until)
    return trial


def table(rows: Sequence[tuple[str, str, int, RefusalTrial]]) -> str:
    """Per (stack, experiment, trial): refused of sent, refusal latency p50/p99 in ms to the
    microsecond, the notice time (``>`` when censored) and the requests admitted after the
    threshold."""
    head = ("stack", "experiment", "trial", "refused", "p50 ms", "p99 ms", "notice ms",
            "admitted after", "codes", "note")  # fmt: skip
    body = []
    for stack, experiment, trial, r in rows:
        notice = fmt(r.notice_ms, ".3f")
        body.append((
            stack, experiment, str(trial), f"{r.refused}/{r.requests}", fmt(r.p50_ms, ".3f"),
            fmt(r.p99_ms, ".3f"), f">{notice}" if r.censored else notice,
            fmt(r.admitted_after, "d"), " ".join(f"{k}:{v}" for k, v in sorted(r.codes.items())),
            r.note,
        ))  # fmt: skip
    columns = [Column(h, align=Align.LEFT if h in ("stack", "experiment", "codes", "note")
                      else Align.RIGHT) for h in head]  # fmt: skip
    return text_table(columns, body, gap=2)


def over_trials(name: str, trials: Sequence[RefusalTrial]) -> str:
    """One stack's figures over its trials, each with its interval: refusal latency p50 and p99
    to the microsecond, the notice time (a lower bound where a trial refused nothing), and each
    trial's requests admitted after the threshold."""
    p50 = interval([t.p50_ms for t in trials], "refused none", floor=0.0)
    p99 = interval([t.p99_ms for t in trials], "refused none", floor=0.0)
    notice = interval([t.notice_ms for t in trials], "no crossing")
    censored = " (no refusal before the pressure ended: a lower bound)" * any(
        t.censored for t in trials
    )
    return (
        f"{name}: refusal p50 {p50.text('.3f', 'ms')}, p99 {p99.text('.3f', 'ms')}; notice "
        f"{notice.text('.3f', 'ms')}{censored}; admitted after the threshold "
        f"{[t.admitted_after for t in trials]}"
    )
