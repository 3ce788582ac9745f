"""Ray Serve LLM as the baseline when the engine is vLLM (docs/design.md, "Ray Serve LLM").

``ray.serve.llm`` (``LLMConfig`` + ``build_openai_app``) set up the way Ray's documentation shows
users: Serve's proxy -> the OpenAI ingress deployment -> ``LLMServer`` replicas, each running
vLLM's engine, with Serve's default router (pow2), Ray's consistent-hash router on ``zl-session``
or Ray's prefix-aware router.
"""

from baselines.rayserve.config import BaselineRouter
from baselines.rayserve_llm.config import LlmBaselineConfig
from baselines.rayserve_llm.standup import LlmBaselineHandle, start_llm_baseline

__all__ = ["BaselineRouter", "LlmBaselineConfig", "LlmBaselineHandle", "start_llm_baseline"]
