"""The Ray Serve orchestrator baseline: proxy -> ingress deployment -> engine-replica deployments.

Built the way teams build the classic middle layer, and configured fairly (see docs/design.md,
"Baseline"): the ingress parses and validates the header contract, keeps per-tenant token budgets
and a bounded FIFO, routes by session, retries before the first token and logs every request.
"""

from baselines.rayserve.config import BaselineConfig
from baselines.rayserve.standup import BaselineHandle, start_baseline

__all__ = ["BaselineConfig", "BaselineHandle", "start_baseline"]
