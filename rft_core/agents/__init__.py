"""Multi-turn agentic rollouts (issue 20): the environment contract (``env``), tool-call formats
(``tools``), the built-in environments (``calculator``, ``python``, ``remote``), and the
token-in-token-out rollout loop (``loop``). ``docs/agents.md`` describes all of it.

The registry of environment names, ``ENVIRONMENTS``, lives on rft_core's lowest floor
(``rft_core.environments``) so that the config can check a name without importing this package.
"""
from __future__ import annotations

from rft_core.agents.env import (
                                 EnvConfigError,
                                 EnvError,
                                 EnvFactory,
                                 Environment,
                                 StepResult,
                                 load_environment_class,
)
from rft_core.agents.loop import AgentRollout, Trajectory, run_agent_rollout
from rft_core.agents.tools import TOOL_FORMATS, ToolCall, ToolCallError, ToolEnvironment, ToolFailure, ToolFormat
from rft_core.config.agents import AgentConfig
from rft_core.environments import ENVIRONMENTS

__all__ = [
                                 "ENVIRONMENTS",
                                 "TOOL_FORMATS",
                                 "AgentConfig",
                                 "AgentRollout",
                                 "EnvConfigError",
                                 "EnvError",
                                 "EnvFactory",
                                 "Environment",
                                 "StepResult",
                                 "ToolCall",
                                 "ToolCallError",
                                 "ToolEnvironment",
                                 "ToolFailure",
                                 "ToolFormat",
                                 "Trajectory",
                                 "load_environment_class",
                                 "run_agent_rollout",
]
