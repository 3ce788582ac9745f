"""Fault injection for both stacks with Chaos Toolkit: providers, controls and recovery metrics.

``actions`` (faults mirroring Chaos Mesh), ``netproxy`` (loopback TCP delay and partition),
``probes`` (a sliding-window SLI and liveness), ``controls`` (background load and telemetry
around each experiment), ``recovery`` (time to detect and recover, losses, blast radius),
``targets`` (the JSON file that tells an experiment where the stack is) and ``runner`` (profile D
on a running stack, and ``zl-bench chaos``). Stacks are stood up by ``harness.stacks``.
"""
