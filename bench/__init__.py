"""bench: the programs a user runs: ``zl-bench`` (run, report, compare, ...) and its benchmarks."""
