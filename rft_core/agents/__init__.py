"""Multi-turn agentic rollouts (issue 20): the environment contract (``env``), tool-call formats
(``tools``), the built-in environments (``calculator``, ``python``, ``remote``), and the
token-in-token-out rollout loop (``loop``). ``docs/agents.md`` describes all of it.

Importing the package registers the built-in environments in ``ENVIRONMENTS``.
"""
from __future__ import annotations

from rft_core.agents import calculator, python_env, remote  # noqa: F401 - register the built-ins
from rft_core.agents.config import AgentConfig
from rft_core.agents.env import (
                                 ENVIRONMENTS,
                                 EnvConfigError,
                                 EnvError,
                                 EnvFactory,
                                 Environment,
                                 StepResult,
                                 load_environment_class,
)
from rft_core.agents.loop import AgentRollout, Trajectory, run_agent_rollout
from rft_core.agents.tools import TOOL_FORMATS, ToolCall, ToolCallError, ToolEnvironment, ToolFailure, ToolFormat

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
