"""``AgentConfig``: the settings of a multi-turn agentic rollout (``rollout.agent``;
``rft_core.agents``)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rft_core.environments import ENVIRONMENTS


class AgentConfig(BaseModel):
    """A multi-turn rollout: the model and an environment take turns (``rft_core.agents.loop``).

    ``max_total_tokens`` counts every token after the prompt: the model's and the observations'.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    environment: str = Field("calculator", description="calculator, python, remote, or 'path/to/file.py:Class' / "
                             "'package.module:Class'")
    env_config: dict[str, Any] = Field(default_factory=dict, description="the environment's settings (its Config)")
    max_turns: int = Field(4, gt=0, description="model turns per trajectory")
    max_total_tokens: int = Field(512, gt=0, description="model + observation tokens after the prompt")
    max_tokens_per_turn: int | None = Field(None, gt=0, description="None: the rest of max_total_tokens")
    max_observation_tokens: int = Field(256, gt=0, description="longer observation texts are cut to this many tokens")
    observation_role: str = Field("tool", description="chat-template role of observations (user for templates without tool)")
    on_env_error: Literal["raise", "fallback"] = Field(
        "raise", description="an environment that raises or is unreachable: fail the rollout (raise), or end the "
        "trajectory with finish_reason env_error and fallback_reward (fallback)")
    fallback_reward: float = 0.0
    env_workers: int = Field(8, gt=0, description="environment steps run at once (threads)")

    @field_validator("environment")
    @classmethod
    def _known(cls, v: str) -> str:
        if ":" not in v and v not in ENVIRONMENTS:
            raise ValueError(f"unknown environment {v!r}; valid names: {', '.join(ENVIRONMENTS.names())}, or "
                             "'path/to/file.py:Class' / 'package.module:Class'")
        return v
