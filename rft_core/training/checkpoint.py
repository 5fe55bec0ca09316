"""Checkpoint files of a training stage: an HF ``save_pretrained`` folder and the AdamW state.

The AdamW state file (``optimizer.pt``, ``torch.save`` of ``optimizer.state_dict()``) of a
mixed-precision update (a bfloat16 model, ``rft_core.training.strategy.MasterWeights``) also
carries the float32 master weights (``"master_weights"``: parameter name -> float32 tensor) and the
dtype the checkpoint's weights are their rounding to (``"master_weights_dtype"``), as DeepSpeed's
and Megatron's optimizer states hold their float32 master copies: the weights folder is what the
rollout loads (bfloat16), the next update continues from the exact float32 weights. Its AdamW
entries are indexed as the model's trainable parameters, each bfloat16 one's moments belonging
to its float32 master: the same layout before and after issue 29 (which moved the forward from
autocast over the masters to the bfloat16 parameters), so either code's file loads in the other.
"""
from __future__ import annotations

from pathlib import Path

import torch

from rft_core.counters import count_bytes_read
from rft_core.models.lora import sorted_target_modules

OPTIMIZER_FILE = "optimizer.pt"
# the policy's optimizer state is the stage "{ppo_update folder}-optimizer" (rft_core.stages.optimizer_state)
OPTIMIZER_FOLDER_SUFFIX = "-optimizer"
# a resident checkpoint iteration's weights written in the background: the stage "{ppo_update folder}-policy"
POLICY_FOLDER_SUFFIX = "-policy"
MASTER_WEIGHTS_KEY = "master_weights"
MASTER_DTYPE_KEY = "master_weights_dtype"


def save_checkpoint(model, tokenizer, optimizer: torch.optim.Optimizer | None, out_dir: str | Path, *,
                    state_dict: dict | None = None) -> None:
    """Write an HF ``save_pretrained`` folder plus the optimizer state (none when ``optimizer``
    is None: a DeepSpeed update, whose state is partitioned over the ranks, or a policy whose
    state is its own stage). ``state_dict``: the weights to write instead of the model's own
    tensors (a host copy of its ``state_dict()``: transformers' ``save_pretrained(state_dict=...)``).

    No RNG state is saved: every random draw of a run comes from a generator seeded with
    (config seed, iteration, stage), so a resumed run draws the same numbers without it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with sorted_target_modules(model):  # a LoRA adapter's config, the same bytes in every process
        model.save_pretrained(out, **({} if state_dict is None else {"state_dict": state_dict}))
    tokenizer.save_pretrained(out)
    if optimizer is not None:
        save_optimizer_state(optimizer.state_dict(), out / OPTIMIZER_FILE)


def save_optimizer_state(state: dict, path: str | Path) -> None:
    """``torch.save`` of an optimizer state dict (``OPTIMIZER_FILE``) without the zip records'
    CRC-32 (``torch.utils.serialization.config.save.compute_crc32``, torch >= 2.6): the stage's
    manifest holds the file's checksum, checked before every read (``schemas.verify_files``), so
    the CRC only cost time, 1.7 of 2.8 s for a 1.26 GB state on this project's 2-core CPU
    (``torch.load`` reads either kind). The config is torch's process-wide one, patched for the
    call (``rft_core.stages.optimizer_state``'s writer thread writes one state at a time).
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6: always with CRC-32
        torch.save(state, path)
        return
    with config.patch({"save.compute_crc32": False}):
        torch.save(state, path)


def read_optimizer_state(ckpt_dir: str | Path | None) -> dict | None:
    """The state dict saved in ``ckpt_dir/optimizer.pt`` (tensors on the CPU), or None when
    ``ckpt_dir`` is None or holds no state.

    Raises:
        ValueError: the file is not a readable optimizer state (named).
    """
    path = Path(ckpt_dir) / OPTIMIZER_FILE if ckpt_dir else None
    if path is None or not path.exists():
        return None

    count_bytes_read(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  unpickling errors of a truncated or foreign file
        raise ValueError(f"{path}: not a readable optimizer state ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError(f"{path}: not an optimizer state dict (keys {sorted(state)[:5] if isinstance(state, dict) else type(state)})")
    return state


def restore_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, *, lr: float | None = None) -> None:
    """Load ``state`` (an ``optimizer.state_dict()``, master-weight entries ignored) into
    ``optimizer``; torch moves the moments to each parameter's device and dtype. ``lr``: the
    configured learning rate replaces the saved one (the state keeps its moments)."""
    optimizer.load_state_dict({k: v for k, v in state.items() if k not in (MASTER_WEIGHTS_KEY, MASTER_DTYPE_KEY)})
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt_dir: str | Path | None, *, lr: float | None = None) -> bool:
    """Restore the optimizer state saved in ``ckpt_dir/optimizer.pt`` (moved to the devices of
    the optimizer's parameters by torch); master weights, if any, are left to ``build_strategy``.

    ``lr``: the configured learning rate replaces the saved one (the state keeps its moments).
    Returns False, leaving the optimizer as it is, when ``ckpt_dir`` is None or has no state.
    """
    state = read_optimizer_state(ckpt_dir)
    if state is None:
        return False
    restore_optimizer_state(optimizer, state, lr=lr)
    return True
