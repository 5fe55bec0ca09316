"""Where the prompts come from: the training data (``data``) and the held-out evaluation
(``eval``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rft_core.config._base import _Frozen


class DataConfig(_Frozen):
    """Prompts from a reasoning-gym task (or the built-in ``humaneval``), seeded; each iteration
    takes the next slice."""

    source: Literal["reasoning_gym"] = "reasoning_gym"
    task: str = "basic_arithmetic"
    task_config: dict[str, int | float | str | bool] = Field(default_factory=dict)
    size: int = Field(2000, gt=0, description="number of distinct training prompts")
    seed: int = 1234
    prompts_per_iteration: int = Field(8, gt=0)
    system_prompt: str = (
        "You are a helpful assistant. Solve the problem. "
        "Give the final answer on the last line as: Answer: <answer>"
    )
    max_prompt_tokens: int = Field(256, gt=0)
    overlong_prompts: Literal["skip", "error"] = "skip"


class EvalConfig(_Frozen):
    """Held-out evaluation (``flows/eval.py``): greedy decoding on prompts of the training task
    whose question texts never occur in the training dataset (``heldout_entries``)."""

    num_prompts: int = Field(200, gt=0, description="held-out prompts, one greedy response each")
    seed: int | None = Field(None, description="dataset seed of the held-out split; None: data.seed + data.size + 1000003")
    max_new_tokens: int | None = Field(None, gt=0, description="None: rollout.max_new_tokens")
    batch_size: int = Field(32, gt=0, description="sequences generated at once")
