"""The harness: stacks, loaders, workload, profiles, result schema, metrics and telemetry.

It sits above the stacks under test (``zerolayer``, ``baselines``) and below the programs that
drive it (``bench``, ``chaos``), and imports neither of those.
"""
