"""Training strategies: how a micro-batch's loss becomes an optimizer step.

``SingleProcess``: ``loss.backward()``, gradient clipping and ``optimizer.step()`` in this
process. ``DeepSpeedStrategy``: DeepSpeed ZeRO stage 1/2/3 data parallelism over the ranks of a
torchrun job (Rajbhandari et al. 2020, arXiv:1910.02054). Every rank reads the same shards; the
micro-batches of each mini-batch are dealt out round-robin over the ranks, every rank runs the
same number of forward/backward passes (a rank with fewer gets zero-weight repeats, since ZeRO
2/3 communicate inside backward), and DeepSpeed's gradient average over ranks is undone by
scaling each loss by the world size, so the step's gradient is the same sum of micro-batch
gradients as in one process: the update matches the single-process one up to float rounding.

DeepSpeed runs with ``managed_gradient_accumulation: false``: ``backward`` only accumulates, each
``step`` is an optimizer step (the caller decides the accumulation boundary, as in one process).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from rft_core.config import CriticConfig, DeepSpeedConfig, UpdateConfig
from rft_core.models.logprobs import default_device
from rft_core.training.checkpoint import load_optimizer_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) and gradient clipping of an update."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    max_grad_norm: float

    @classmethod
    def of(cls, cfg: UpdateConfig | CriticConfig) -> "OptimizerSettings":
        """The settings of the policy's (``update``) or the critic's config section."""
        return cls(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)


def make_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (Loshchilov & Hutter 2019, arXiv:1711.05101)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the gradient norm, then step; a step whose gradient norm is not finite is skipped
    (gradients dropped). Returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def build_strategy(model: torch.nn.Module, *, optim: OptimizerSettings, deepspeed: DeepSpeedConfig | None = None,
                   optimizer_state: str | None = None, device: torch.device | None = None) -> "SingleProcess | DeepSpeedStrategy":
    """The strategy that trains ``model``: DeepSpeed ZeRO when ``deepspeed`` is set (it places
    the model on its rank's device and starts AdamW afresh), else one process with the model on
    ``device`` (default ``default_device()``) and AdamW continued from ``optimizer_state`` (a
    folder holding ``optimizer.pt``; None: fresh), with the configured learning rate."""
    if deepspeed is not None:
        return DeepSpeedStrategy(model, zero_stage=deepspeed.zero_stage, lr=optim.lr, betas=optim.betas,
                                 weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
                                 offload_optimizer=deepspeed.offload_optimizer, torch_adam=deepspeed.torch_adam)
    model.to(device or default_device())  # before the optimizer, so its state lands on the same device
    opt = make_optimizer(model, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    load_optimizer_state(opt, optimizer_state, lr=optim.lr)
    return SingleProcess(model, opt, max_grad_norm=optim.max_grad_norm)


class SingleProcess:
    """One process: plain autograd, clip, AdamW step (a non-finite gradient norm skips the step)."""

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> None:
        self.model, self.optimizer, self.max_grad_norm = model, optimizer, max_grad_norm

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss``."""
        loss.backward()

    def step(self) -> float:
        """Clip and step; returns the gradient norm before clipping."""
        return clip_and_step(self.model, self.optimizer, self.max_grad_norm)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over ranks (here: the values themselves)."""
        return list(values)

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])


def collective_device(backend: str) -> torch.device:
    """Where the tensors of a collective must live for ``backend``: this rank's GPU for NCCL
    (which accepts only CUDA tensors), the CPU for gloo and the others."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed for DeepSpeed (once per process): nccl on a GPU, gloo on CPU.
    Outside torchrun a world of one rank on 127.0.0.1 is set up. Returns (rank, world size)."""
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # not under torchrun: a single-rank world
            os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(_free_port())})
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
    weights (on rank 0 for ZeRO-3).
    """

    def __init__(self, model: torch.nn.Module, *, zero_stage: int, lr: float, betas: tuple[float, float],
                 weight_decay: float, max_grad_norm: float, offload_optimizer: bool = False,
                 torch_adam: bool = True) -> None:
        import deepspeed
        import torch.distributed as dist

        self.rank, self.world_size = init_distributed()
        self.zero_stage = zero_stage
        bf16 = next(model.parameters()).dtype == torch.bfloat16
        cfg = deepspeed_config(zero_stage=zero_stage, lr=lr, betas=betas, weight_decay=weight_decay,
                               max_grad_norm=max_grad_norm, offload_optimizer=offload_optimizer, torch_adam=torch_adam,
                               bf16=bf16)
        params = [p for p in model.parameters() if p.requires_grad]
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        self._dist = dist

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
