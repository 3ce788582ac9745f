"""bench: profiles, loaders, metrics, telemetry and the report."""
