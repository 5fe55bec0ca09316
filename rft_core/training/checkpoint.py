"""Checkpoint files of a training stage: an HF ``save_pretrained`` folder and the AdamW state."""
from __future__ import annotations

from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.pt"
# the policy's optimizer state is the stage "{ppo_update folder}-optimizer" (rft_core.stages.optimizer_state)
OPTIMIZER_FOLDER_SUFFIX = "-optimizer"


def save_checkpoint(model, tokenizer, optimizer: torch.optim.Optimizer | None, out_dir: str | Path) -> None:
    """Write an HF ``save_pretrained`` folder plus the optimizer state (none when ``optimizer``
    is None: a DeepSpeed update, whose state is partitioned over the ranks, or a policy whose
    state is its own stage).

    No RNG state is saved: every random draw of a run comes from a generator seeded with
    (config seed, iteration, stage), so a resumed run draws the same numbers without it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt_dir: str | Path | None, *, lr: float | None = None) -> bool:
    """Restore the optimizer state saved in ``ckpt_dir/optimizer.pt`` (moved to the devices of
    the optimizer's parameters by torch).

    ``lr``: the configured learning rate replaces the saved one (the state keeps its moments).
    Returns False, leaving the optimizer as it is, when ``ckpt_dir`` is None or has no state.
    """
    path = Path(ckpt_dir) / OPTIMIZER_FILE if ckpt_dir else None
    if path is None or not path.exists():
        return False
    optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return True
