"""``zl-bench aa``: compare's false-alarm rate, measured. The same configuration is run ``2 x
--pairs`` times, one run after another, and each disjoint pair (run 0 against run 1, 2 against
3, ...) goes through ``zl-bench compare``'s own decision: with nothing changed, every regression
it flags is a false alarm. The rate is reported with its Clopper-Pearson interval (scipy) over
the comparable pairs, and incomparable pairs (too few valid trials, hosts of different speeds)
are counted apart: they are what compare refuses, not alarms. Everything goes to ``aa.json`` in
the output directory, written after each pair so that an interrupted check keeps its pairs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from scipy import stats as sps

from bench import run as bench_run
from bench.report.compare import Verdict, compare_runs
from bench.report.data import load_run
from bench.stack_options import add_stack_arguments, config_from
from harness import schema
from harness.runner.config import RunConfig
from harness.runner.console import say
from harness.runner.ending import EXIT_STATUS
from harness.schema.files import write_json_atomic
from serving.cliargs import positive_int

AA_FILE: Final = "aa.json"
DEFAULT_PAIRS: Final = 10


@dataclass(frozen=True, slots=True)
class Pair:
    """One A/A comparison: the two runs and compare's verdict, with what it flagged."""

    a: str
    b: str
    verdict: Verdict
    flagged: list[str] = field(default_factory=list)
    incomparable: list[str] = field(default_factory=list)


@dataclass(slots=True)
class AaResult:
    """The check so far: every pair, and the false-alarm rate over the comparable ones."""

    threshold: float
    confidence: float
    pairs: list[Pair] = field(default_factory=list)

    @property
    def comparable(self) -> list[Pair]:
        return [p for p in self.pairs if p.verdict is not Verdict.INCOMPARABLE]

    @property
    def alarms(self) -> int:
        return sum(p.verdict is Verdict.REGRESSION for p in self.pairs)

    def rate(self) -> tuple[float | None, float | None, float | None]:
        """False alarms over comparable pairs, with its exact binomial interval."""
        n = len(self.comparable)
        if n == 0:
            return None, None, None
        ci = sps.binomtest(self.alarms, n).proportion_ci(self.confidence, method="exact")
        return self.alarms / n, float(ci.low), float(ci.high)

    def line(self) -> str:
        rate, low, high = self.rate()
        n, apart = len(self.comparable), len(self.pairs) - len(self.comparable)
        if rate is None:
            return f"no comparable pair in {len(self.pairs)} ({apart} incomparable)"
        return (
            f"false alarms {self.alarms} of {n} comparable pairs: {rate:.0%} "
            f"[{low:.0%}, {high:.0%}] ({self.confidence:.0%} Clopper-Pearson); "
            f"{apart} pair(s) incomparable"
        )


class _Stopped(Exception):
    """One of the check's runs was ended by SIGINT or SIGTERM: the check ends with it."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _one_run(config: RunConfig, out: Path) -> Path:
    """One run of ``config`` under ``out``; its results directory."""
    out.mkdir(parents=True, exist_ok=True)
    status = bench_run.run(replace(config, out=str(out)))
    if status in EXIT_STATUS.values():
        raise _Stopped(status)
    runs = [p for p in out.iterdir() if (p / schema.RUN_META).exists()]
    return max(runs, key=lambda p: p.stat().st_mtime)


def _judge(a: Path, b: Path, threshold: float, confidence: float) -> Pair:
    got = compare_runs(load_run(a), load_run(b), threshold=threshold, confidence=confidence)
    flagged = [f"{r.stack}/{r.profile} {r.metric}" for r in got.regressions]
    return Pair(str(a), str(b), got.verdict, flagged, list(got.incomparable))


def _save(root: Path, result: AaResult) -> None:
    rate, low, high = result.rate()
    data = schema.to_data(result) | {
        "false_alarm_rate": rate,
        "interval": [low, high],
        "summary": result.line(),
    }
    write_json_atomic(root / AA_FILE, data)


def check(config: RunConfig, pairs: int, threshold: float, confidence: float) -> AaResult:
    """Run the pairs and judge each; aa.json is rewritten after each."""
    root = Path(config.out) / time.strftime("aa-%Y%m%d-%H%M%S")
    result = AaResult(threshold, confidence)
    for k in range(pairs):
        say(f"A/A pair {k + 1} of {pairs}")
        a = _one_run(config, root / f"pair{k}-a")
        b = _one_run(config, root / f"pair{k}-b")
        result.pairs.append(_judge(a, b, threshold, confidence))
        _save(root, result)
        say(f"A/A pair {k + 1}: {result.pairs[-1].verdict.name.lower()}; {result.line()}")
    say(f"A/A: {result.line()} -> {root / AA_FILE}")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench aa``'s arguments: the pairs and compare's settings, then those of ``run``."""
    parser.add_argument("--pairs", type=positive_int, default=DEFAULT_PAIRS, help="A/A pairs")
    parser.add_argument(
        "--threshold", type=float, default=0.10, help="compare's relative-change threshold"
    )
    parser.add_argument("--confidence", type=float, default=0.95, help="compare's CI level")
    parser.add_argument(
        "--profiles", type=bench_run.profile_list, default="a", help="as for zl-bench run"
    )
    add_stack_arguments(parser)


def run_command(args: argparse.Namespace) -> int:
    from bench.report.compare import check_settings

    check_settings(args.threshold, args.confidence)
    config = config_from(args, tuple(args.profiles))
    try:
        check(config, args.pairs, args.threshold, args.confidence)
    except _Stopped as stopped:  # what was judged before it is kept in aa.json
        say("A/A stopped by a signal during a run: the pairs judged so far are kept")
        return stopped.status
    return 0
