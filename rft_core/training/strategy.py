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

Mixed precision (a model loaded in bfloat16, i.e. ``policy.dtype: bfloat16``). One process: the
16-bit trainable parameters get float32 master copies (``MasterWeights``) that AdamW updates, so
its state is float32 too, and the forward and loss run under ``torch.autocast`` in bfloat16; the
float32 gradients land on the master weights (Micikevicius et al. 2018, arXiv:1710.03740, sec. 3.1;
PyTorch AMP). AdamW on bfloat16 parameters would lose every step below half a bfloat16 ulp
(between 2**-9 and 2**-8 of the weight: a 1e-6 step is lost on every weight of magnitude
>= 2**-11 = 4.9e-4, whose half ulp is >= 2**-20 = 9.5e-7). After training the
model holds its weights in bfloat16 again (the checkpoint the next rollout loads) and the float32
master weights travel in the optimizer state dict (``"master_weights"``), which the next update
loads (``build_strategy(optimizer_state=...)``), so steps below bfloat16 resolution accumulate
across iterations as they do within one. DeepSpeed keeps its own bf16 path (bfloat16 weights,
float32 master partitions and AdamW state inside ZeRO).

DeepSpeed across iterations: ``DeepSpeedStrategy.save_state`` writes the ZeRO state with
DeepSpeed's own sharded checkpoint (``engine.save_checkpoint``: every rank its partition of the
float32 master weights and the AdamW moments, rank 0 the module states), and the next update
loads it (``deepspeed_state``: ``engine.load_checkpoint`` with the optimizer states), so AdamW
and, in bf16, the float32 masters continue across iterations as in one process. A state is
continued only by the same world size, ZeRO stage and dtype (``check_deepspeed_state``), and only
from the weights it was saved with (the local weight partitions before and after the load must
agree).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from rft_core.config import CriticConfig, DeepSpeedConfig, UpdateConfig
from rft_core.models.hub import torch_dtype
from rft_core.models.logprobs import default_device, model_device
from rft_core.training.checkpoint import (
    MASTER_DTYPE_KEY,
    MASTER_WEIGHTS_KEY,
    OPTIMIZER_FILE,
    read_optimizer_state,
    restore_optimizer_state,
)

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
    """AdamW over the trainable parameters (Loshchilov & Hutter 2019, arXiv:1711.05101), torch's
    fused implementation where every parameter is a float tensor on the CPU or a CUDA device
    (one kernel for all parameters: 0.07 s instead of 0.26 s per step for SmolLM2-135M on two
    CPU cores; the same update up to float rounding), else the default (foreach) one."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the gradient norm, then step; a step whose gradient norm is not finite is skipped
    (gradients dropped). Returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


HALF_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: the 16-bit floating dtype of its parameters when it has
    some (a bfloat16 policy, a LoRA adapter in float32 on a bfloat16 base), else float32.

    Raises:
        ValueError: parameters in both bfloat16 and float16.
    """
    half = {p.dtype for p in model.parameters() if p.dtype in HALF_DTYPES}
    if len(half) > 1:
        raise ValueError(f"the model mixes parameter dtypes {sorted(str(d) for d in half)}; load it in one dtype")
    return half.pop() if half else torch.float32


class MasterWeights:
    """Float32 master weights of a model's 16-bit trainable parameters (mixed precision).

    ``promote`` makes each such parameter hold float32 data (its master weight: AdamW then
    updates and keeps its state in float32); ``demote`` makes it hold the bfloat16 rounding of it
    again (round to nearest even) and keeps the float32 tensor aside, so that ``state()`` still
    returns the exact master weights. The Parameter objects stay the same (only ``.data`` is
    swapped), so an optimizer built over them keeps working. Parameters are named as in
    ``model.named_parameters()`` (tied weights once).

    Args:
        model: the model, its 16-bit trainable parameters still in ``compute_dtype``.
        compute_dtype: torch.bfloat16 (float16 would need loss scaling, which is not implemented).
    Raises:
        ValueError: ``compute_dtype`` is not bfloat16.
    """

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        if compute_dtype != torch.bfloat16:
            raise ValueError(f"mixed precision supports bfloat16 compute only, not {compute_dtype}: float16 needs "
                             "loss scaling (a GradScaler), which is not implemented; use dtype bfloat16 or float32")
        self.compute_dtype = compute_dtype
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad and p.dtype == compute_dtype}
        self._aside: dict[str, torch.Tensor] | None = None  # float32 masters while demoted

    def promote(self, saved: dict[str, torch.Tensor] | None = None, *, saved_dtype: str | None = None,
                source: str = "optimizer state") -> None:
        """Parameters hold float32 master weights: ``saved`` ones (checked against the loaded
        weights with ``check_master_weights``), the ones set aside by ``demote``, or the current
        16-bit values upcast (exactly).

        Raises:
            ValueError: ``saved`` does not belong to these weights (see ``check_master_weights``).
        """
        if saved is not None:
            check_master_weights(self.params, saved, saved_dtype=saved_dtype, source=source)
        for name, p in self.params.items():
            if saved is not None:
                p.data = saved[name].to(device=p.device, dtype=torch.float32)
            elif self._aside is not None:
                p.data = self._aside[name]
            elif p.dtype != torch.float32:
                p.data = p.data.float()
            p.grad = None
        self._aside = None

    def demote(self) -> None:
        """Parameters hold the ``compute_dtype`` rounding of their master weights again (what a
        checkpoint saves and an inference pass uses); the float32 masters are kept aside."""
        if self._aside is not None:
            return
        self._aside = {}
        for name, p in self.params.items():
            self._aside[name] = p.data
            p.data = p.data.to(self.compute_dtype)
            p.grad = None

    def state(self) -> dict[str, torch.Tensor]:
        """name -> the float32 master weight (the live tensors: do not modify them)."""
        if self._aside is not None:
            return dict(self._aside)
        return {name: p.data for name, p in self.params.items()}

    def add_to_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
        """``Optimizer.register_state_dict_post_hook`` hook: the optimizer state dict also carries
        the master weights (``"master_weights"``) and the dtype the checkpoint rounds them to."""
        state_dict[MASTER_WEIGHTS_KEY] = self.state()
        state_dict[MASTER_DTYPE_KEY] = str(self.compute_dtype).removeprefix("torch.")
        return state_dict


def check_master_weights(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], *, saved_dtype: str | None,
                         source: str) -> None:
    """Check that float32 master weights ``saved`` belong to the loaded ``params``: the same
    names, the same shapes, and each master rounded to ``saved_dtype`` (the dtype its checkpoint
    was written in) equals the loaded weight exactly (``master.to(saved_dtype).to(p.dtype) == p``).

    Raises:
        ValueError: a name missing on either side, another shape, or a weight that is not the
            rounding of its master (the optimizer state of another checkpoint), naming ``source``.
    """
    missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or extra:
        raise ValueError(f"{source}: the master weights do not match the model's trainable parameters "
                         f"(missing {missing[:3]}, unexpected {extra[:3]})")
    rounding = torch_dtype(saved_dtype) if saved_dtype else None
    for name, p in params.items():
        m = saved[name]
        if tuple(m.shape) != tuple(p.shape):
            raise ValueError(f"{source}: master weight {name!r} has shape {tuple(m.shape)}, the model's {tuple(p.shape)}")
        rounded = m.to(device=p.device, dtype=rounding or p.dtype).to(p.dtype)
        if not torch.equal(rounded, p.data):
            raise ValueError(f"{source}: master weight {name!r} does not round to the loaded checkpoint's weight: "
                             "this optimizer state belongs to another checkpoint")


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
    """

    folder: str
    tag: str
    world_size: int
    zero_stage: int
    bf16: bool
    source: str


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
    how = ("keep runners.ppo_update.nproc_per_node (and --nnodes) and update.deepspeed as they were for this run, or "
           "start a new run root from this checkpoint's weights (its policy/ folder as policy.path)")
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
                                  f"this update trains a {now} model (policy.dtype changed); {how}")


def build_strategy(model: torch.nn.Module, *, optim: OptimizerSettings, deepspeed: DeepSpeedConfig | None = None,
                   optimizer_state: str | None = None, device: torch.device | None = None,
                   compute_dtype: str | torch.dtype | None = None,
                   deepspeed_state: DeepSpeedCheckpoint | None = None,
                   keeps_deepspeed_state: bool = False) -> "SingleProcess | DeepSpeedStrategy":
    """The strategy that trains ``model``.

    DeepSpeed ZeRO when ``deepspeed`` is set: it places the model on its rank's device, trains a
    bfloat16 model with its own bf16 mode (float32 master partitions) and continues the ZeRO
    state ``deepspeed_state`` (AdamW moments and float32 master partitions, with the configured
    learning rate and clipping; None: AdamW starts afresh, the masters from the loaded weights).
    Otherwise one process with the model on ``device`` (default ``default_device()``) and AdamW
    continued from ``optimizer_state`` (a folder holding ``optimizer.pt``; None: fresh), with the
    configured learning rate. A bfloat16 model trains in mixed precision (``MasterWeights``, module
    docstring): float32 master weights, restored from the optimizer state when it carries them
    (else the loaded bfloat16 weights upcast), float32 AdamW state, bfloat16 autocast.

    Args:
        compute_dtype: the dtype name (``"bfloat16"``, ``"float32"``, ``"auto"``) or torch dtype
            the model was loaded in; None: ``compute_dtype_of(model)``. bfloat16 on a float32
            model is plain automatic mixed precision (float32 weights, bfloat16 autocast).
        keeps_deepspeed_state: the caller saves this DeepSpeed update's state for the next one
            (``DeepSpeedStrategy.save_state``; the policy update does). False (the critic): a
            bfloat16 model gets a warning that its float32 masters end with this update.
    Raises:
        ValueError: float16 compute, a 16-bit model with another compute dtype, or saved master
            weights of another checkpoint (named).
        DeepSpeedStateError: ``deepspeed_state`` without ``deepspeed``, ``optimizer_state`` with
            it, or a ZeRO state this update cannot continue (``check_deepspeed_state``, or the
            state of other weights).
    """
    if deepspeed is not None:
        if optimizer_state is not None:
            raise DeepSpeedStateError(f"{optimizer_state}: a single-process AdamW state (optimizer.pt) cannot be "
                                      "continued by a DeepSpeed update; keep update.deepspeed the same across a run")
        if compute_dtype_of(model) == torch.bfloat16 and not keeps_deepspeed_state:
            log.warning("DeepSpeed bf16: the float32 master weights live inside ZeRO for this update only; the "
                        "next iteration starts from the bfloat16 checkpoint (steps below bfloat16 resolution within "
                        "one iteration are kept, across iterations they are rounded away)")
        return DeepSpeedStrategy(model, zero_stage=deepspeed.zero_stage, lr=optim.lr, betas=optim.betas,
                                 weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
                                 offload_optimizer=deepspeed.offload_optimizer, torch_adam=deepspeed.torch_adam,
                                 state=deepspeed_state)
    if deepspeed_state is not None:
        raise DeepSpeedStateError(f"{deepspeed_state.source}: a DeepSpeed ZeRO optimizer state cannot be continued "
                                  "by a single-process update (update.deepspeed is not set); keep update.deepspeed "
                                  "the same across a run")
    loaded = compute_dtype_of(model)
    dtype = torch_dtype(compute_dtype) if isinstance(compute_dtype, str) else (compute_dtype or loaded)
    if loaded in HALF_DTYPES and dtype != loaded:
        raise ValueError(f"the model's parameters are {loaded} but the compute dtype is {dtype}: load the model in "
                         f"the compute dtype (AdamW on 16-bit parameters without master weights loses small steps)")
    model.to(device or default_device())  # before the optimizer, so its state lands on the same device
    saved = read_optimizer_state(optimizer_state)
    source = str(Path(optimizer_state or ".") / OPTIMIZER_FILE)
    masters, saved_dtype = (saved.pop(MASTER_WEIGHTS_KEY, None), saved.pop(MASTER_DTYPE_KEY, None)) if saved else (None, None)
    master = MasterWeights(model, dtype) if dtype in HALF_DTYPES else None  # compute dtype and 16-bit weights
    if master is not None and master.params:
        if saved is not None and masters is None:
            log.info("%s holds no master weights: the float32 masters start from the loaded %s weights", source, dtype)
        master.promote(masters, saved_dtype=saved_dtype, source=source)
    elif masters:  # float32 trainable weights (a bfloat16 run continued in float32): the masters, not their rounding
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        check_master_weights(params, masters, saved_dtype=saved_dtype, source=source)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(masters[name])
    opt = make_optimizer(model, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    if saved is not None:
        restore_optimizer_state(opt, saved, lr=optim.lr)
    if master is not None and master.params:
        opt.register_state_dict_post_hook(master.add_to_state_dict)
    return SingleProcess(model, opt, max_grad_norm=optim.max_grad_norm, master=master)


class SingleProcess:
    """One process: plain autograd, clip, AdamW step (a non-finite gradient norm skips the step).

    With ``master`` (mixed precision): the forward runs under bfloat16 autocast (``autocast``)
    and the optimizer updates the float32 master weights, which the parameters hold inside
    ``training()``; outside it they hold the bfloat16 weights.
    """

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
                 master: MasterWeights | None = None) -> None:
        self.model, self.optimizer, self.max_grad_norm, self.master = model, optimizer, max_grad_norm, master
        if master is None and any(p.requires_grad and p.dtype in HALF_DTYPES for p in model.parameters()):
            log.warning("training 16-bit parameters without float32 master weights: optimizer steps below half a "
                        "16-bit ulp are lost (build the strategy with build_strategy for mixed precision)")

    def training(self) -> ContextManager[None]:
        """The context of a training run: parameters hold the float32 master weights inside it
        and the bfloat16 weights after it (mixed precision; otherwise nothing changes)."""
        return _master_context(self.master)

    def autocast(self) -> ContextManager[Any]:
        """The context of a forward pass and its loss: bfloat16 autocast on the model's device
        type in mixed precision, else nothing."""
        if self.master is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=model_device(self.model).type, dtype=self.master.compute_dtype)

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


@contextlib.contextmanager
def _master_context(master: MasterWeights | None):
    if master is None:
        yield
        return
    master.promote()
    try:
        yield
    finally:
        master.demote()


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
        if torch.cuda.is_available():  # NCCL: this rank's GPU is the current device before any collective
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        elif os.environ.get("RFT_DS_SHM_COMM") != "1":
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
        copy of each trainable weight (its partition under ZeRO-3)."""
        rows = []
        for p in self.model.module.parameters():
            if not p.requires_grad:
                continue
            t = (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().double()
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
