"""Training strategies: how a micro-batch's loss becomes an optimizer step.

``SingleProcess``: ``loss.backward()``, gradient clipping and ``optimizer.step()`` in this
process. ``FSDPStrategy`` (``rft_core.training.fsdp``): torch's FSDP2, one ``fully_shard`` per
decoder layer plus the root, sharing a step over ranks as DeepSpeed does (below), its sharded
state a ``torch.distributed.checkpoint``. ``DeepSpeedStrategy``: DeepSpeed ZeRO stage 1/2/3 data parallelism over the ranks of a
torchrun job (Rajbhandari et al. 2020, arXiv:1910.02054). Every rank reads the same shards; the
micro-batches of each mini-batch are dealt out round-robin over the ranks, every rank runs the
same number of forward/backward passes (a rank with fewer gets zero-weight repeats, since ZeRO
2/3 communicate inside backward), and DeepSpeed's gradient average over ranks is undone by
scaling each loss by the world size, so the step's gradient is the same sum of micro-batch
gradients as in one process: the update matches the single-process one up to float rounding.

DeepSpeed runs with ``managed_gradient_accumulation: false``: ``backward`` only accumulates, each
``step`` is an optimizer step (the caller decides the accumulation boundary, as in one process).

Mixed precision (a model loaded in bfloat16, i.e. ``policy.dtype: bfloat16``), one process, as
DeepSpeed's ``BF16_Optimizer`` (deepspeed/runtime/bf16_optimizer.py, DeepSpeed 0.19.8) and Megatron-LM's
``Float16OptimizerWithFloat16Params`` (megatron/core/optimizer/optimizer.py) do it: the model's
parameters stay bfloat16, the very weights the rollout engine and the log-prob passes run, and
the forward and backward run on them in bfloat16, without autocast; so the update's log-probs of
a policy are, bit for bit, the actor and reference passes' log-probs of the same weights and
micro-batch (issue 29: under autocast over float32 weights the first step saw approx_kl ~2e-3
between a policy and its identical reference and old policy; what remains is the bfloat16
kernels' dependence on how samples are grouped into micro-batches, the same between two
log-prob passes: tests/rft_core/training/test_bf16_logprob_agreement.py). Each
micro-batch's bfloat16 weight gradient is added into a float32 gradient of a float32 master copy
as soon as autograd has accumulated it (a post-accumulate-grad hook, then the bfloat16 gradient
is dropped: DeepSpeed's ``immediate_grad_update`` / ``accumulate_hp_grads_and_remove_lp``,
Megatron's ``DistributedDataParallel._make_backward_post_hook``: ``main_grad.add_(grad); grad =
None``), so gradient accumulation over micro-batches sums in float32. Clipping and AdamW work on
the float32 masters and gradients (AdamW state float32; the masters take the places of the
bfloat16 parameters in the optimizer's parameter list, as Megatron's ``main_param`` do, so the
state dict's layout is that of an optimizer over the model's parameters), and after each step
the masters are rounded (to nearest even) into the bfloat16 parameters (DeepSpeed
``update_lp_params``, Megatron ``_copy_main_params_to_model_params``). AdamW on bfloat16
parameters alone would lose every step below half a bfloat16 ulp (between 2**-9 and 2**-8 of the
weight: a 1e-6 step is lost on every weight of magnitude >= 2**-11 = 4.9e-4, whose half ulp is
>= 2**-20 = 9.5e-7); the masters keep them (Micikevicius et al. 2018, arXiv:1710.03740, sec. 3.1).
The float32 masters travel in the optimizer state dict (``"master_weights"``), which the next
update loads (``build_strategy(optimizer_state=...)``), so steps below bfloat16 resolution
accumulate across iterations as they do within one. A model whose trainable weights are float32
on a bfloat16 base (LoRA adapters) computes in those dtypes too (the adapters are their own
masters); only a float32 model given a bfloat16 ``compute_dtype`` runs under autocast (plain AMP).
DeepSpeed keeps its own bf16 path (bfloat16 weights, float32 master partitions and AdamW state
inside ZeRO).

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
import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from rft_core.config import CriticConfig, DeepSpeedConfig, FSDPConfig, UpdateConfig
from rft_core.models.hub import torch_dtype
from rft_core.models.logprobs import default_device, model_device
from rft_core.training.checkpoint import (
    MASTER_DTYPE_KEY,
    MASTER_WEIGHTS_KEY,
    OPTIMIZER_FILE,
    read_optimizer_state,
    restore_optimizer_state,
)
from rft_core.training.fsdp import (  # noqa: F401 - re-exported beside DeepSpeed's
    FSDPCheckpoint,
    FSDPStateError,
    FSDPStrategy,
    check_fsdp_state,
    weights_on_rank0,
)
from rft_core.training.zero import (  # noqa: F401 - re-exported: the strategy module is their public home
    DeepSpeedCheckpoint,
    DeepSpeedStateError,
    DeepSpeedStrategy,
    check_deepspeed_state,
    collective_device,
    deepspeed_config,
    init_distributed,
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


def make_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                   params: list[torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (Loshchilov & Hutter 2019, arXiv:1711.05101), torch's
    fused implementation where every parameter is a float tensor on the CPU or a CUDA device
    (one kernel for all parameters: 0.07 s instead of 0.26 s per step for SmolLM2-135M on two
    CPU cores; the same update up to float rounding), else the default (foreach) one.

    Args:
        params: the tensors to optimize instead of ``model``'s trainable parameters (mixed
            precision: ``MasterWeights.optimizer_params``, the float32 masters in their places).
    """
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor ``optimizer`` updates, in its param groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the gradient norm of the optimizer's tensors (the model's trainable parameters, or in
    mixed precision their float32 masters), then step; a step whose gradient norm is not finite
    is skipped (gradients dropped, the model's too). Returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(optimizer_params(optimizer), max_grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
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


# model -> the MasterWeights whose gradient hooks its parameters carry (weak: the model may be dropped)
_MASTERS_OF_MODEL: "weakref.WeakKeyDictionary[torch.nn.Module, MasterWeights]" = weakref.WeakKeyDictionary()


class MasterWeights:
    """Float32 master weights and gradients of a model's bfloat16 trainable parameters (mixed
    precision, module docstring; DeepSpeed ``BF16_Optimizer``, Megatron-LM
    ``Float16OptimizerWithFloat16Params``).

    The model's parameters keep their bfloat16 data at all times (what forward and backward, a
    checkpoint and an inference pass use). Each gets a float32 master tensor (same shape and
    device, ``masters``) that the optimizer updates in its place (``optimizer_params``). A
    post-accumulate-grad hook on each bfloat16 parameter adds its gradient, upcast exactly, into
    its master's float32 ``.grad`` as soon as a backward pass has accumulated it, and drops the
    bfloat16 gradient: micro-batch gradients are summed in float32, never in bfloat16.
    ``to_params`` rounds the masters into the parameters (round to nearest even) after a step.
    Parameters are named as in ``model.named_parameters()`` (tied weights once: one master, one
    gradient sum for the embedding and the LM head).

    One ``MasterWeights`` per model: building another over the same model removes this one's
    hooks (``detach``).

    Args:
        model: the model, its 16-bit trainable parameters in ``compute_dtype``, already on the
            device it trains on (the masters are made there).
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
        self.masters = {name: p.detach().to(torch.float32, copy=True) for name, p in self.params.items()}
        previous = _MASTERS_OF_MODEL.get(model)
        if previous is not None:
            previous.detach()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(name)) for name, p in self.params.items()]
        _MASTERS_OF_MODEL[model] = self

    def _grad_hook(self, name: str):
        master = self.masters[name]

        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if master.grad is None:
                master.grad = grad.detach().to(torch.float32, copy=True)
            else:
                # float32 += bfloat16: the bfloat16 value is upcast exactly and summed in float32
                master.grad.add_(grad.detach())
            param.grad = None

        return accumulate

    def detach(self) -> None:
        """Remove the gradient hooks (the model's bfloat16 gradients then stay on it)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def load(self, saved: dict[str, torch.Tensor], *, saved_dtype: str | None = None,
             source: str = "optimizer state") -> None:
        """Make the masters the ``saved`` float32 ones (an optimizer state's ``master_weights``),
        after checking that they belong to the parameters' weights (``check_master_weights``).

        Raises:
            ValueError: ``saved`` does not belong to these weights (see ``check_master_weights``).
        """
        check_master_weights(self.params, saved, saved_dtype=saved_dtype, source=source)
        with torch.no_grad():
            for name, m in self.masters.items():
                m.copy_(saved[name])

    def optimizer_params(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The tensors AdamW updates: ``model``'s trainable parameters in their order, each
        bfloat16 one replaced by its float32 master (so an optimizer state dict has the layout
        of one over the model's parameters)."""
        masters_by_id = {id(p): self.masters[name] for name, p in self.params.items()}
        return [masters_by_id.get(id(p), p) for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def to_params(self) -> None:
        """Round every master into its bfloat16 parameter (round to nearest even, as ``.to``)."""
        for name, p in self.params.items():
            p.copy_(self.masters[name])

    def state(self) -> dict[str, torch.Tensor]:
        """name -> the float32 master weight (the live tensors: do not modify them)."""
        return dict(self.masters)

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


def build_strategy(model: torch.nn.Module, *, optim: OptimizerSettings, deepspeed: DeepSpeedConfig | None = None,
                   optimizer_state: str | None = None, device: torch.device | None = None,
                   compute_dtype: str | torch.dtype | None = None,
                   deepspeed_state: DeepSpeedCheckpoint | None = None,
                   keeps_deepspeed_state: bool = False, fsdp: FSDPConfig | None = None,
                   fsdp_state: FSDPCheckpoint | None = None) -> "SingleProcess | DeepSpeedStrategy | FSDPStrategy":
    """The strategy that trains ``model``.

    torch's FSDP2 when ``fsdp`` is set (``FSDPStrategy``, ``rft_core.training.fsdp``): one
    ``fully_shard`` per decoder layer and the root over this job's ranks, float32 master shards
    of a bfloat16 model, the sharded state ``fsdp_state`` continued (on any number of ranks;
    None: AdamW afresh).

    DeepSpeed ZeRO when ``deepspeed`` is set: it places the model on its rank's device, trains a
    bfloat16 model with its own bf16 mode (float32 master partitions) and continues the ZeRO
    state ``deepspeed_state`` (AdamW moments and float32 master partitions, with the configured
    learning rate and clipping; None: AdamW starts afresh, the masters from the loaded weights).
    Otherwise one process with the model on ``device`` (default ``default_device()``) and AdamW
    continued from ``optimizer_state`` (a folder holding ``optimizer.pt``; None: fresh), with the
    configured learning rate. A bfloat16 model trains in mixed precision (``MasterWeights``, module
    docstring): forward and backward on its bfloat16 parameters, float32 master weights (restored
    from the optimizer state when it carries them, else the loaded bfloat16 weights upcast) and
    float32 gradients, float32 AdamW state. An optimizer state saved before issue 29 (AdamW over
    the parameters while they held the float32 masters, which it carries as ``master_weights``)
    has the same layout and continues exactly.

    Args:
        compute_dtype: the dtype name (``"bfloat16"``, ``"float32"``, ``"auto"``) or torch dtype
            the model was loaded in; None: ``compute_dtype_of(model)``. bfloat16 on a model
            without 16-bit weights is plain automatic mixed precision (float32 weights, bfloat16
            autocast).
        keeps_deepspeed_state: the caller saves this DeepSpeed update's state for the next one
            (``DeepSpeedStrategy.save_state``; the policy and critic updates do). False: a
            bfloat16 model gets a warning that its float32 masters end with this update.
    Raises:
        ValueError: float16 compute, a 16-bit model with another compute dtype, or saved master
            weights of another checkpoint (named).
        DeepSpeedStateError: ``deepspeed_state`` without ``deepspeed``, ``optimizer_state`` with
            it, or a ZeRO state this update cannot continue (``check_deepspeed_state``, or the
            state of other weights).
        FSDPStateError: ``fsdp`` with ``deepspeed``, a state of another kind handed to FSDP2 or an
            FSDP2 state to another strategy, or one ``FSDPStrategy.load_state`` refuses.
    """
    _check_state_kinds(deepspeed=deepspeed, fsdp=fsdp, optimizer_state=optimizer_state,
                       deepspeed_state=deepspeed_state, fsdp_state=fsdp_state)
    if fsdp is not None:
        return FSDPStrategy(model, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                            max_grad_norm=optim.max_grad_norm, reshard_after_forward=fsdp.reshard_after_forward,
                            cpu_offload=fsdp.cpu_offload, state=fsdp_state)
    if deepspeed is not None:
        return _deepspeed_strategy(model, optim=optim, deepspeed=deepspeed, optimizer_state=optimizer_state,
                                   deepspeed_state=deepspeed_state, keeps_deepspeed_state=keeps_deepspeed_state)
    if deepspeed_state is not None:
        raise DeepSpeedStateError(f"{deepspeed_state.source}: a DeepSpeed ZeRO optimizer state cannot be continued "
                                  "by a single-process update (update.deepspeed is not set); keep update.deepspeed "
                                  "the same across a run")
    return _single_process(model, optim=optim, optimizer_state=optimizer_state, device=device,
                           compute_dtype=compute_dtype)


def _check_state_kinds(*, deepspeed: DeepSpeedConfig | None, fsdp: FSDPConfig | None, optimizer_state: str | None,
                       deepspeed_state: DeepSpeedCheckpoint | None, fsdp_state: FSDPCheckpoint | None) -> None:
    """Refuse a saved state of another kind than the strategy ``build_strategy`` builds (FSDP2's
    sharded state, DeepSpeed's ZeRO partitions, one process's ``optimizer.pt``), and FSDP2 with
    DeepSpeed.

    Raises:
        FSDPStateError: naming the state and both kinds, and to keep the setting across a run.
    """
    if fsdp is not None and deepspeed is not None:
        raise FSDPStateError("update.fsdp and update.deepspeed both set: FSDP2 and DeepSpeed ZeRO each shard the "
                             "model over the ranks; keep one")
    keep = "keep update.fsdp (and update.deepspeed) the same across a run"
    if fsdp is None and fsdp_state is not None:
        now = "DeepSpeed" if deepspeed is not None else "single-process"
        raise FSDPStateError(f"{fsdp_state.source}: an FSDP2 sharded optimizer state cannot be continued by a {now} "
                             f"update (update.fsdp is not set); {keep}")
    if fsdp is not None and (optimizer_state is not None or deepspeed_state is not None):
        what = (f"{optimizer_state}: a single-process AdamW state (optimizer.pt)" if optimizer_state is not None
                else f"{deepspeed_state.source}: a DeepSpeed ZeRO optimizer state")  # type: ignore[union-attr]
        raise FSDPStateError(f"{what} cannot be continued by an FSDP2 update; {keep}")


def _deepspeed_strategy(model: torch.nn.Module, *, optim: OptimizerSettings, deepspeed: DeepSpeedConfig,
                        optimizer_state: str | None, deepspeed_state: DeepSpeedCheckpoint | None,
                        keeps_deepspeed_state: bool) -> "DeepSpeedStrategy":
    """``build_strategy`` under DeepSpeed ZeRO (its arguments)."""
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


def _single_process(model: torch.nn.Module, *, optim: OptimizerSettings, optimizer_state: str | None,
                    device: torch.device | None, compute_dtype: str | torch.dtype | None) -> "SingleProcess":
    """``build_strategy`` in one process (its arguments): the model on ``device``, its float32
    master weights in mixed precision (``_master_weights``), AdamW continued from ``optimizer_state``."""
    loaded = compute_dtype_of(model)
    dtype = torch_dtype(compute_dtype) if isinstance(compute_dtype, str) else (compute_dtype or loaded)
    if loaded in HALF_DTYPES and dtype != loaded:
        raise ValueError(f"the model's parameters are {loaded} but the compute dtype is {dtype}: load the model in "
                         f"the compute dtype (AdamW on 16-bit parameters without master weights loses small steps)")
    model.to(device or default_device())  # before the optimizer, so its state lands on the same device
    saved = read_optimizer_state(optimizer_state)
    source = str(Path(optimizer_state or ".") / OPTIMIZER_FILE)
    master = _master_weights(model, dtype, saved, source=source)
    opt = make_optimizer(model, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                         params=master.optimizer_params(model) if master is not None else None)
    if saved is not None:
        restore_optimizer_state(opt, saved, lr=optim.lr)
    if master is not None:
        opt.register_state_dict_post_hook(master.add_to_state_dict)
    # autocast only for a model without 16-bit weights asked to compute in 16 bits (plain AMP)
    autocast_dtype = dtype if dtype in HALF_DTYPES and loaded == torch.float32 else None
    return SingleProcess(model, opt, max_grad_norm=optim.max_grad_norm, master=master, autocast_dtype=autocast_dtype)


def _master_weights(model: torch.nn.Module, dtype: torch.dtype, saved: dict | None, *,
                    source: str) -> MasterWeights | None:
    """The float32 master weights of a 16-bit ``dtype`` model (None: no 16-bit trainable weights),
    restored from the optimizer state ``saved`` when it carries them (popped from it, with their
    dtype), else the loaded weights upcast. A float32 model continued from a state that carries
    masters (a bfloat16 run continued in float32) gets the masters copied into its trainable
    parameters instead of their rounding.

    Raises:
        ValueError: float16 ``dtype``, or saved master weights of another checkpoint (named).
    """
    masters, saved_dtype = (saved.pop(MASTER_WEIGHTS_KEY, None), saved.pop(MASTER_DTYPE_KEY, None)) if saved else (None, None)
    master = MasterWeights(model, dtype) if dtype in HALF_DTYPES else None  # refuses float16
    if master is not None and not master.params:  # no 16-bit trainable weights (LoRA adapters, a float32 model)
        master = None
    if master is not None:
        if saved is not None and masters is None:
            log.info("%s holds no master weights: the float32 masters start from the loaded %s weights", source, dtype)
        elif masters is not None:
            master.load(masters, saved_dtype=saved_dtype, source=source)
    elif masters:  # float32 trainable weights (a bfloat16 run continued in float32): the masters, not their rounding
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        check_master_weights(params, masters, saved_dtype=saved_dtype, source=source)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(masters[name])
    return master


class SingleProcess:
    """One process: plain autograd, clip, AdamW step (a non-finite gradient norm skips the step).

    With ``master`` (mixed precision, ``MasterWeights``): the forward and backward run on the
    model's bfloat16 parameters as they are (no autocast), each backward's bfloat16 gradients
    land in the masters' float32 gradients, clipping and AdamW work on the float32 masters, and
    each step ends by rounding the masters into the bfloat16 parameters. ``autocast_dtype``: the
    forward runs under autocast to that dtype (a float32 model with a 16-bit compute dtype).
    """

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
                 master: MasterWeights | None = None, autocast_dtype: torch.dtype | None = None) -> None:
        self.model, self.optimizer, self.max_grad_norm, self.master = model, optimizer, max_grad_norm, master
        self.autocast_dtype = autocast_dtype
        self._before_step: list[Callable[[], None]] = []
        if master is None and any(p.requires_grad and p.dtype in HALF_DTYPES for p in model.parameters()):
            log.warning("training 16-bit parameters without float32 master weights: optimizer steps below half a "
                        "16-bit ulp are lost (build the strategy with build_strategy for mixed precision)")

    def training(self) -> ContextManager[None]:
        """The context of a training run: nothing to switch (the parameters hold the weights the
        forward uses, bfloat16 ones in mixed precision, inside and after it)."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager[Any]:
        """The context of a forward pass and its loss: autocast to ``autocast_dtype`` on the
        model's device type when set, else nothing (mixed precision computes in the bfloat16
        parameters' own dtype, as the inference passes do)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=model_device(self.model).type, dtype=self.autocast_dtype)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the optimizer's, the float32 masters' in mixed precision,
        and the model's)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (mixed precision: each bfloat16 parameter's hook adds
        its gradient into its master's float32 gradient as backward produces it)."""
        loss.backward()

    def wait_before_step(self, wait: Callable[[], None]) -> None:
        """Have the next ``step`` call ``wait()`` first (once): a background write still reads this
        strategy's weights or optimizer state (``rft_core.stages.optimizer_state``), which the
        forward and backward passes leave alone and the step changes. ``wait`` may raise (a failed
        write); the step then raises it and changes nothing."""
        self._before_step.append(wait)

    def step(self) -> float:
        """Clip and step (in mixed precision: the float32 master gradients and weights, then the
        masters rounded into the bfloat16 parameters); returns the gradient norm before clipping.
        First the waits ``wait_before_step`` queued, in order."""
        while self._before_step:
            self._before_step.pop(0)()
        grad_norm = clip_and_step(self.model, self.optimizer, self.max_grad_norm)
        if self.master is not None and math.isfinite(grad_norm):
            self.master.to_params()
        return grad_norm

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over ranks (here: the values themselves)."""
        return list(values)

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])


def continue_with(strategy: "SingleProcess | DeepSpeedStrategy | FSDPStrategy", *, lr: float,
                  max_grad_norm: float) -> None:
    """Apply an update's learning rate and clipping to a strategy kept from an earlier update (a
    resident worker's), as a strategy built from storage gets them when it restores its optimizer
    state with the configured learning rate (``restore_optimizer_state``,
    ``DeepSpeedStrategy.load_state``); the other AdamW settings stay those the state was created with."""
    if isinstance(strategy, (SingleProcess, FSDPStrategy)):
        strategy.max_grad_norm = max_grad_norm
    elif hasattr(strategy.optimizer, "clip_grad"):  # ZeRO's optimizer clips
        strategy.optimizer.clip_grad = max_grad_norm
    for group in strategy.optimizer.param_groups:
        group["lr"] = lr
