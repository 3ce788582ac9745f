"""Baseline stacks the zero-layer stack is compared against (today: Ray Serve)."""
