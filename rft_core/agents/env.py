"""The environment contract of multi-turn agentic rollouts (no Prefect, no model).

One environment instance serves one trajectory (it may keep state between turns):

- ``reset(prompt: dict) -> str | None``: called once before the first model turn with the
  prompt row (``prompt_id``, ``sample_index``, ``data_source``, ``question``, ``answer``,
  ``prompt_text``, ``metadata`` (the decoded ``metadata_json``), and any other JSON-able column
  of the prompts shard). A returned text is the first observation, shown to the model before
  its first turn (rendered in the observation role of the chat template); None shows nothing.
- ``step(text: str) -> StepResult``: called after every model turn with the decoded text of
  that turn only (special tokens skipped). The environment parses the tool call itself (see
  ``rft_core.agents.tools``) and answers with a ``StepResult``.
- ``close()``: optional, called once when the trajectory ends (also after a failure).

An environment is named in ``ENVIRONMENTS`` (the built-ins ``calculator``, ``python``,
``remote``) or loaded from ``path/to/file.py:Class`` / ``package.module:Class``. A class that
declares ``Config`` (a pydantic model, frozen, ``extra="forbid"``) is built as ``Class(config)``
with the user's settings validated by it; a class without one is built as ``Class()``.

Failure semantics (``docs/agents.md``): a tool that fails gives an error observation (the env's
business, see ``ToolEnvironment``); an environment that raises from ``reset``/``step`` or breaks
the contract is an *environment* failure, which the rollout loop either raises (default) or turns
into a trajectory with ``finish_reason="env_error"`` and a marked fallback reward.
"""
from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from rft_core.environments import ENVIRONMENTS
from rft_core.rewards.base import RewardError
from rft_core.rewards.user import load_function


class EnvError(RuntimeError):
    """An environment failed (raised, broke the contract, or its server is unreachable); the
    message names the environment (and the server URL for ``remote``)."""


class EnvConfigError(ValueError):
    """An environment cannot be built: unknown name, bad ``file.py:Class`` spec, or settings its
    ``Config`` refuses; raised before any generation."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn.

    Attributes:
        observation: text shown to the model as the next message (observation/tool role); None
            shows nothing, and then the trajectory ends (there is nothing to continue from).
        reward: this step's reward (a finite float) or None (counts 0). The trajectory's
            ``env_reward`` is the SUM over its steps.
        done: True ends the trajectory (``finish_reason="stop"``).
        info: free-form dict; the loop reads ``info["tool_call"] = {"name", "arguments"}`` (the
            call the env parsed) and ``info["error"]`` (a tool failure, also said in the
            observation) into the trajectory's tool-call records.
    """

    observation: str | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of environments (subclassing it is optional: any class with ``step`` and
    optionally ``reset``/``close``/``stop_strings`` works).

    Attributes:
        Config: pydantic model of the environment's settings, or None (built as ``Class()``).
        stop_strings: strings that end a model turn besides EOS (a tool call's end tag); the
            turn's text includes the stop string.
    """

    Config: ClassVar[type[BaseModel] | None] = None
    stop_strings: tuple[str, ...] = ()

    def reset(self, prompt: dict[str, Any]) -> str | None:
        """Start a trajectory for ``prompt`` (the row described in the module docstring); return
        the first observation or None."""
        return None

    def step(self, text: str) -> StepResult:
        """Answer the model's turn ``text``. Raises: NotImplementedError (subclasses implement it)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Release what the trajectory held (sessions, processes). Default: nothing."""


def coerce_step_result(value: Any, *, where: str) -> StepResult:
    """Check what ``step`` returned: a ``StepResult``, a gym-style ``(observation, reward, done,
    info)`` tuple or a dict with those keys.

    Raises:
        EnvError: another type, an observation that is not text or None, a reward that is not a
            finite number or None, ``done`` not a bool, or ``info`` not a dict; the message
            names ``where`` and the value.
    """
    if isinstance(value, tuple) and len(value) == 4:
        value = StepResult(*value)
    elif isinstance(value, dict) and set(value) <= {"observation", "reward", "done", "info"}:
        value = StepResult(**value)
    if not isinstance(value, StepResult):
        raise EnvError(f"{where}: step returned {type(value).__name__} {value!r:.120}; expected a StepResult, an "
                       "(observation, reward, done, info) tuple or a dict with those keys")
    if value.observation is not None and not isinstance(value.observation, str):
        raise EnvError(f"{where}: observation is {type(value.observation).__name__} {value.observation!r:.120}, not text or None")
    reward = value.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
            raise EnvError(f"{where}: reward is {reward!r:.80}, not a finite number or None")
        reward = float(reward)
    if not isinstance(value.done, bool):
        raise EnvError(f"{where}: done is {value.done!r:.80}, not a bool")
    if not isinstance(value.info, dict):
        raise EnvError(f"{where}: info is {type(value.info).__name__}, not a dict")
    return StepResult(value.observation, reward, value.done, value.info)


def load_environment_class(spec: str) -> type:
    """The environment class named ``spec``: a name registered in ``ENVIRONMENTS`` (a class, or
    for a built-in the import path of one, ``rft_core.environments``), or ``path/to/file.py:Class`` /
    ``package.module:Class`` (imported with the reward functions' loader,
    ``rft_core.rewards.user.load_function``; a relative file is taken from the current
    directory).

    Raises:
        EnvConfigError: unknown name (the message lists the registered ones), an import failure
            or missing attribute (naming the spec and file), or an object that is not a class
            with a ``step`` method.
    """
    if ":" not in spec:
        if spec not in ENVIRONMENTS:
            raise EnvConfigError(f"unknown environment {spec!r}; valid names: {', '.join(ENVIRONMENTS.names())}, "
                                 "or 'path/to/file.py:Class' / 'package.module:Class'")
        entry = ENVIRONMENTS[spec]
        if not isinstance(entry, str):
            return entry
        spec = entry  # a built-in, registered by its import path (rft_core.environments)
    try:
        cls = load_function(spec, kind="environment")
    except RewardError as exc:
        raise EnvConfigError(str(exc)) from exc
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise EnvConfigError(f"environment {spec!r}: {cls!r:.80} is not a class with a step(text) method")
    return cls


def environment_fingerprint(spec: str) -> str | None:
    """sha256 (hex) of the source file of a user environment class (``file.py:Class`` /
    ``module:Class``), so that editing it changes the rollout stage's config hash (a committed
    rollout is then reported stale instead of silently reused); None for a registered name
    (its code is this package's). Only the defining file is hashed, not what it imports.

    Raises:
        EnvConfigError: the class cannot be imported (``load_environment_class``) or has no
            Python source file.
    """
    if ":" not in spec:
        return None
    cls = load_environment_class(spec)
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if not path or not Path(path).is_file():
        raise EnvConfigError(f"environment {spec!r}: no Python source file to fingerprint")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class EnvFactory:
    """Builds one environment per trajectory, with the settings validated once up front.

    Args:
        environment: a registered name or a ``file.py:Class`` / ``module:Class`` spec.
        config: the environment's settings (validated by its ``Config``).
    Raises:
        EnvConfigError: see ``load_environment_class``; settings that ``Config`` refuses (the
            message names the environment and pydantic's errors); settings given to a class
            that declares no ``Config``.
    """

    def __init__(self, environment: str, config: dict[str, Any] | None = None) -> None:
        self.name = environment
        self.cls = load_environment_class(environment)
        model = getattr(self.cls, "Config", None)
        if inspect.isclass(model) and issubclass(model, BaseModel):
            try:
                self.config: BaseModel | None = model.model_validate(config or {})
            except ValidationError as exc:
                raise EnvConfigError(f"environment {environment!r}: bad settings: {exc}") from exc
        elif config:
            raise EnvConfigError(f"environment {environment!r}: {self.cls.__name__} declares no Config, so it takes "
                                 f"no settings; got {sorted(config)}")
        else:
            self.config = None

    def new(self) -> Any:
        """A fresh environment instance (``Class(config)`` or ``Class()``).

        Raises:
            EnvError: the constructor raised (the message names the environment).
        """
        try:
            return self.cls(self.config) if self.config is not None else self.cls()
        except Exception as exc:
            raise EnvError(f"environment {self.name!r}: building {self.cls.__name__} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
