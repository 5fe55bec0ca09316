"""DeepSpeed ZeRO for the training loop (``rft_core.training.strategy`` builds it): the process
group (``init_distributed``), the engine's config, ``DeepSpeedStrategy`` and the checks on a
saved ZeRO state (``DeepSpeedCheckpoint``, ``check_deepspeed_state``). See the strategy module's
docstring for how ranks share a step and how the ZeRO state is kept across updates."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from rft_core.network import free_port


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """A ZeRO state saved by ``DeepSpeedStrategy.save_state`` (DeepSpeed's sharded checkpoint
    format) and what it was saved under.

    Attributes:
        folder: local folder given to ``engine.save_checkpoint`` (holds ``latest`` and ``{tag}/``).
        tag: the checkpoint tag inside ``folder``.
        world_size: data-parallel ranks that wrote it (one ZeRO partition file each).
        zero_stage: the ZeRO stage it was written under (1, 2 or 3).
        bf16: whether it was written in DeepSpeed's bf16 mode (float32 master partitions of
            bfloat16 weights).
        source: what to name in errors (the optimizer stage's URI).
        role: whose state it is, ``"policy"`` or ``"critic"``: the settings an error names
            (``RESUME_SETTINGS``).
    """

    folder: str
    tag: str
    world_size: int
    zero_stage: int
    bf16: bool
    source: str
    role: str = "policy"


# the settings a refused state's error names, by role: (what sets its ranks, its sharding key, its dtype key, the
# checkpoint folder a new run can start from and the key that takes it)
RESUME_SETTINGS = {"policy": ("runners.ppo_update.nproc_per_node (and --nnodes) or orchestration.policy_ranks",
                              "update.deepspeed", "policy.dtype", "its policy/ folder as policy.path"),
                   "critic": ("runners.critic_update.nproc_per_node (and --nnodes) or orchestration.critic_ranks",
                              "critic.deepspeed", "critic.model.dtype", "its critic/ folder as critic.model.path")}


class DeepSpeedStateError(ValueError):
    """A saved ZeRO state this DeepSpeed update cannot continue: another world size, ZeRO stage
    or dtype, the state of other weights, a single-process ``optimizer.pt`` handed to DeepSpeed
    or a ZeRO state handed to a single-process update."""


def check_deepspeed_state(state: DeepSpeedCheckpoint, *, world_size: int, zero_stage: int, bf16: bool) -> None:
    """Refuse to continue ``state`` under another world size, ZeRO stage or dtype: DeepSpeed
    loads a ZeRO checkpoint's partitions only into the layout that wrote them (its universal
    checkpoint, which re-partitions, is not used here).

    Raises:
        DeepSpeedStateError: names ``state.source``, the saved and the current value, and how
            to go on.
    """
    ranks, key, dtype_key, folder = RESUME_SETTINGS[state.role]
    how = (f"keep {ranks} and {key} as they were for this run, or "
           f"start a new run root from this checkpoint's weights ({folder})")
    if state.world_size != world_size:
        raise DeepSpeedStateError(f"{state.source}: this DeepSpeed optimizer state was saved by {state.world_size} "
                                  f"ranks but this update runs on {world_size}: ZeRO partitions cannot be re-split "
                                  f"between world sizes; {how}")
    if state.zero_stage != zero_stage:
        raise DeepSpeedStateError(f"{state.source}: this DeepSpeed optimizer state was saved under ZeRO stage "
                                  f"{state.zero_stage} but this update runs ZeRO stage {zero_stage}; {how}")
    if state.bf16 != bf16:
        saved, now = ("bfloat16" if state.bf16 else "float32"), ("bfloat16" if bf16 else "float32")
        raise DeepSpeedStateError(f"{state.source}: this DeepSpeed optimizer state was saved by a {saved} model but "
                                  f"this update trains a {now} model ({dtype_key} changed); {how}")


def collective_device(backend: str) -> torch.device:
    """Where the tensors of a collective must live for ``backend``: this rank's GPU for NCCL
    (which accepts only CUDA tensors), the CPU for gloo and the others."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_rank() -> None:
    """What a process needs before it joins torch.distributed's default group with the ``env://``
    rendezvous: outside torchrun (no ``WORLD_SIZE``) the environment of a world of one rank on
    127.0.0.1 (a free port); on a GPU, this rank's device (``LOCAL_RANK``) made current, which
    NCCL needs before any collective. Used by ``init_distributed`` (DeepSpeed) and
    ``rft_core.training.fsdp.init_process_group`` (FSDP2)."""
    if "WORLD_SIZE" not in os.environ:  # not under torchrun: a single-rank world
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())})
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed for DeepSpeed (once per process): nccl on a GPU, gloo on CPU.
    Outside torchrun a world of one rank on 127.0.0.1 is set up (``prepare_rank``). Returns
    (rank, world size)."""
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        prepare_rank()
        if not torch.cuda.is_available() and os.environ.get("RFT_DS_SHM_COMM") != "1":
            # DeepSpeed's CPU backend compiles a shared-memory allreduce op with the system C++
            # compiler on first use; plain gloo needs no compiler (set RFT_DS_SHM_COMM=1 for the op)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def deepspeed_config(*, zero_stage: int, lr: float, betas: tuple[float, float], weight_decay: float,
                     max_grad_norm: float, offload_optimizer: bool = False, torch_adam: bool = True,
                     bf16: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of an update: ZeRO ``zero_stage``, AdamW with the update's settings
    (``torch_adam``: torch's implementation, no compiled ops), clipping at ``max_grad_norm``."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": 1e-8,
                                                  "weight_decay": weight_decay, "torch_adam": torch_adam}},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedStrategy:
    """DeepSpeed ZeRO over the ranks of this job (see the module docstring).

    ``model`` is the DeepSpeed engine (call it like the module); ``full_state_dict()`` gathers the
    weights (on rank 0 for ZeRO-3); ``save_state`` writes the ZeRO state (AdamW moments, float32
    master partitions) that the next update continues (``state``).

    Raises:
        DeepSpeedStateError: ``state`` cannot be continued here (``load_state``).
    """

    def __init__(self, model: torch.nn.Module, *, zero_stage: int, lr: float, betas: tuple[float, float],
                 weight_decay: float, max_grad_norm: float, offload_optimizer: bool = False,
                 torch_adam: bool = True, state: DeepSpeedCheckpoint | None = None) -> None:
        import deepspeed
        import torch.distributed as dist

        self.rank, self.world_size = init_distributed()
        self.zero_stage = zero_stage
        self.bf16 = next(model.parameters()).dtype == torch.bfloat16
        if state is not None:  # before the engine partitions anything: a mismatch fails fast
            check_deepspeed_state(state, world_size=self.world_size, zero_stage=zero_stage, bf16=self.bf16)
        cfg = deepspeed_config(zero_stage=zero_stage, lr=lr, betas=betas, weight_decay=weight_decay,
                               max_grad_norm=max_grad_norm, offload_optimizer=offload_optimizer, torch_adam=torch_adam,
                               bf16=self.bf16)
        # frozen weights (a LoRA base) come from the policy checkpoint: not written again into each state
        self._frozen = any(not p.requires_grad for p in model.parameters())
        params = [p for p in model.parameters() if p.requires_grad]
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        self._dist = dist
        if state is not None:
            self.load_state(state, lr=lr, max_grad_norm=max_grad_norm)

    @property
    def module(self) -> torch.nn.Module:
        """The model inside the engine (``save_pretrained``, its config)."""
        return self.model.module

    def save_state(self, folder: str, tag: str) -> None:
        """Write the ZeRO state with DeepSpeed's ``engine.save_checkpoint(folder, tag=tag)`` (a
        collective: call it on every rank): each rank writes its partition of the float32 master
        weights and AdamW moments (``{tag}/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``),
        rank 0 (every rank under ZeRO-3) the module states, rank 0 ``latest``. Frozen weights are
        left out. ``folder`` must be one shared folder, or one folder per rank that the caller
        merges."""
        self.model.save_checkpoint(folder, tag=tag, save_latest=True, exclude_frozen_parameters=self._frozen)

    def _local_fingerprint(self) -> torch.Tensor:
        """(number of trainable parameters, 2) float64: sum and sum of squares of this rank's
        copy of each trainable weight (under ZeRO-3 its partition without the padding that makes
        every rank's partition ``ds_tensor.ds_numel`` long: a weight of fewer elements than ranks,
        like a critic head's bias, is all padding on the last ranks, and ``load_checkpoint`` need
        not restore padding; the valid length as in DeepSpeed 0.19's
        ``runtime/zero/partition_parameters.py``, ``AllGatherHandle.wait``)."""
        rows = []
        for p in self.model.module.parameters():
            if not p.requires_grad:
                continue
            if hasattr(p, "ds_tensor"):
                size = p.ds_tensor.ds_numel
                t = p.ds_tensor.detach().flatten()[:max(0, min(p.ds_numel - self.rank * size, size))]
            else:
                t = p.detach()
            t = t.double()
            rows.append(torch.stack([t.sum(), t.square().sum()]))
        return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)

    def load_state(self, state: DeepSpeedCheckpoint, *, lr: float, max_grad_norm: float) -> None:
        """Continue the saved ZeRO state ``state`` with DeepSpeed's ``engine.load_checkpoint``
        (optimizer states on: AdamW moments and steps, float32 master partitions; the module
        states it saved come along and must equal the weights already loaded), then apply this
        update's learning rate and clipping (the other AdamW settings stay those of the state, as
        in ``restore_optimizer_state``). A collective: every rank calls it.

        Raises:
            DeepSpeedStateError: another world size, ZeRO stage or dtype
                (``check_deepspeed_state``); the checkpoint's files are not in ``state.folder``; or
                its weights are not the loaded ones (the state of another checkpoint), on every rank.
        """
        check_deepspeed_state(state, world_size=self.world_size, zero_stage=self.zero_stage, bf16=self.bf16)
        before = self._local_fingerprint()
        load_path, _ = self.model.load_checkpoint(state.folder, tag=state.tag, load_module_strict=not self._frozen,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise DeepSpeedStateError(f"{state.source}: DeepSpeed found no checkpoint with tag {state.tag!r} in "
                                      f"{state.folder}")
        mismatched = int((self._local_fingerprint() != before).any(dim=1).sum())
        mismatched = int(self.all_reduce_sum([float(mismatched)])[0])
        if mismatched:
            raise DeepSpeedStateError(f"{state.source}: this DeepSpeed optimizer state holds other weights than the "
                                      f"checkpoint this update loaded ({mismatched} weight partition(s) differ): it "
                                      "belongs to another checkpoint")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if hasattr(self.optimizer, "clip_grad"):  # ZeRO keeps the saved clipping; this update's applies
            self.optimizer.clip_grad = max_grad_norm

    def training(self) -> ContextManager[None]:
        """Nothing to do: DeepSpeed's bf16 mode keeps its own float32 master weights."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager[None]:
        """Nothing: the module computes in its own dtype (bfloat16 in DeepSpeed's bf16 mode)."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Gradients are zeroed by DeepSpeed after each step."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``world_size * loss`` (DeepSpeed averages gradients over ranks)."""
        self.model.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self) -> float:
        """Reduce gradients, clip, AdamW step; returns the global gradient norm before clipping."""
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks, on the device the process group's
        backend communicates from (``collective_device``: NCCL accepts only CUDA tensors)."""
        t = torch.tensor(values, dtype=torch.float64, device=collective_device(self._dist.get_backend()))
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)
        return t.tolist()

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every weight of the module, gathered (a collective: call it on every rank). ZeRO-3
        returns it on rank 0 only (None elsewhere)."""
        if self.zero_stage == 3:
            return self.model._zero3_consolidated_16bit_state_dict()
        return self.model.module.state_dict()

    def barrier(self) -> None:
        """Wait for every rank."""
        self._dist.barrier()
