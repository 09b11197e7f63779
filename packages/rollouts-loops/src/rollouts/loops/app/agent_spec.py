"""The RL run file's [agent] section: an agent program trained through the agent endpoint."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollouts.types import check_fields, require


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSpec:
    """An agent by import path and its bounds (rollouts.loops.agent_rollout)."""

    fn: str = ""
    """Import path of `async def run(base_url, record) -> float | None` ("my_agent.py:run"): it talks to
    base_url with any OpenAI-compatible client; its return is the reward (None: [reward] fn scores
    the episode). Empty: no agent."""
    timeout_s: float = 300.0
    """Bound on one episode (the agent's whole run)."""
    max_turns: int = 16
    """Requests one episode may make."""
    max_total_tokens: int = 4096
    """Tokens of one episode's context (prompt and everything after)."""
    request_timeout_s: float = 120.0
    """Bound on one engine call."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0, f"AgentSpec.{name}", value, "be a finite number > 0")
        require(self.max_turns >= 1, "AgentSpec.max_turns", self.max_turns, "be >= 1")
        require(self.max_total_tokens >= 2, "AgentSpec.max_total_tokens", self.max_total_tokens, "be >= 2")
