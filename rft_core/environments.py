"""The registry of multi-turn environments by name (``rollout.agent.environment``).

It sits on the lowest floor (docs/architecture.md, "Layers") so that the config checks an
environment name when it loads (``rft_core.config.agents``) without importing the agents, which
import the config. A built-in environment is registered by the import path of its class
(``package.module:Class``, the form ``rollout.agent.environment`` also accepts) and imported when
a rollout builds it (``rft_core.agents.env.load_environment_class``), as transformers' auto
classes name their model classes; a user may register a class itself
(``ENVIRONMENTS.register("mine")(MyEnv)``) before the config loads.
"""
from __future__ import annotations

from rft_core.registry import Registry

ENVIRONMENTS: Registry[type | str] = Registry("environment")

ENVIRONMENTS.register("calculator", info="safe arithmetic on <calc>expr</calc> or hermes tool calls")(
    "rft_core.agents.calculator:CalculatorEnv")
ENVIRONMENTS.register("python", info="runs <python>code</python> calls in the code_exec sandbox")(
    "rft_core.agents.python_env:PythonEnv")
ENVIRONMENTS.register("remote", info="an HTTP environment server (reset/step JSON protocol)")(
    "rft_core.agents.remote:RemoteEnv")
