"""``nox -s perf``: the replica's CPU per streamed token has not regressed.

``bench.perf`` measures, in one process and one run, the replica's token path over h2c and over
HTTP/1.1 and a bare h2 echo server's, each path's CPU per token as a ratio to the echo's (the
same host, the same minutes: a slow or busy machine moves both). The baseline those ratios are
held to is ``perf_baseline.json`` beside this file, stored on this machine with
``python -m bench.perf --rounds 15 --write-baseline benchmarks/perf_baseline.json``; a ratio past
its baseline by more than the stored tolerance fails, naming the path.
"""

from __future__ import annotations

from pathlib import Path

from bench.perf import read_baseline, regressions, run

BASELINE = Path(__file__).with_name("perf_baseline.json")


def test_the_replicas_cpu_per_token_has_not_regressed() -> None:
    baseline = read_baseline(BASELINE)
    figures = run(rounds=11, per_round=100)
    print("\n".join(figures.lines()))
    assert not regressions(figures, baseline), "\n".join(regressions(figures, baseline))
