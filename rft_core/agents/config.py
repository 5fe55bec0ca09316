"""The agent settings live with the other config sections (``rft_core.config.agents``, the
``rollout.agent`` section); re-exported here for the agents package."""
from rft_core.config.agents import AgentConfig

__all__ = ["AgentConfig"]
