"""torch's FSDP2 (``torch.distributed.fsdp.fully_shard``, torch >= 2.6; written against 2.13)
for the training loop, beside DeepSpeed ZeRO (``rft_core.training.zero``): the process group
(``init_process_group``), the wrapping (``shard_model``), ``FSDPStrategy`` and the checks on a
saved sharded state (``FSDPCheckpoint``, ``check_fsdp_state``).

Wrapping, as verl (``verl/utils/fsdp_utils.py`` ``apply_fsdp2``), TRL (through accelerate's
``fsdp2_prepare_model``, which wraps the classes of ``_no_split_modules`` the same way) and
torchtitan (``torchtitan/models/llama3/infra/parallelize.py`` ``apply_fsdp``) do it: one
``fully_shard`` per decoder layer (the module classes the HF model names in
``_no_split_modules``), then one on the root, which holds the embeddings, the final norm and the
LM head (tied or not: a tied embedding and head are one parameter of the root's group). Every
parameter becomes a ``DTensor`` sharded on dim 0 over the ranks; a layer's parameters are
all-gathered before its forward and, with ``reshard_after_forward``, freed after it and gathered
again in backward (ZeRO-3's memory; off: ZeRO-2's, the gathered layer kept until backward).
Gradients are reduce-scattered in float32 (``MixedPrecisionPolicy.reduce_dtype``) into the
sharded ``.grad`` of each parameter, where micro-batches accumulate.

How ranks share a step is the DeepSpeed strategy's (``rft_core.training.loop``): every rank reads
the same shards, the micro-batches of a mini-batch are dealt out round-robin (zero-weight repeats
so that every rank runs as many forward/backward passes: FSDP2 all-gathers inside them), and
FSDP2's average over ranks is undone by scaling each loss by the world size, so a step's gradient
is the single-process sum: the update equals the single-process one up to float rounding.
Clipping is ``torch.nn.utils.clip_grad_norm_`` over the sharded gradients: DTensor computes each
shard's norm and reduces them over the mesh (a collective), so every rank clips with the global
norm (verl's ``fsdp2_clip_grad_norm_`` is the same call).

Mixed precision (a model loaded in bfloat16, ``policy.dtype: bfloat16``): the sharded parameters
are float32 masters (the loaded bfloat16 weights upcast, exactly) and
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` casts each gathered layer to
bfloat16 for forward and backward, so the update computes on the bfloat16 weights the rollout
and the log-prob passes use, as the single-process ``MasterWeights`` does; gradients are upcast
to float32 before the reduce-scatter and summed in float32 across micro-batches; AdamW (state
float32) steps the float32 shards; the checkpoint's weights are their rounding to bfloat16. A
LoRA model (float32 adapters on a frozen bfloat16 base) keeps each parameter's dtype
(``param_dtype=None``): the adapters are their own masters, as in one process.

Across iterations (``save_state`` / ``load_state``): the sharded model (float32 masters) and
AdamW state are written with ``torch.distributed.checkpoint`` (DCP: every rank its shards, a
``.metadata`` file describing the global tensors) into the policy update's optimizer stage
(``rft_core.stages.optimizer_state``), and loaded by the next update through DCP, which reshards:
a state written by N ranks is continued by M ranks. It is continued only in the same dtype and
only from the weights it was saved with (every loaded master must round to the loaded weight).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch

from rft_core.models.pretrained import meta_shell
from rft_core.training.zero import collective_device, prepare_rank

log = logging.getLogger(__name__)

# the DCP folder inside the optimizer stage (its ``.metadata`` and ``__{rank}_0.distcp`` files)
FSDP_TAG = "dcp"


@dataclass(frozen=True)
class FSDPCheckpoint:
    """A sharded state saved by ``FSDPStrategy.save_state`` (a ``torch.distributed.checkpoint``
    folder) and what it was saved under.

    Attributes:
        folder: local folder of the DCP checkpoint (holds ``.metadata`` and the ranks' ``.distcp`` files).
        world_size: ranks that wrote it (DCP reshards it onto any other number).
        bf16: whether its model state is the float32 masters of a bfloat16 model.
        source: what to name in errors and logs (the optimizer stage's URI).
        role: whose state it is, ``"policy"`` or ``"critic"`` (the dtype key an error names).
    """

    folder: str
    world_size: int
    bf16: bool
    source: str
    role: str = "policy"


class FSDPStateError(ValueError):
    """A saved FSDP2 state this update cannot continue: another dtype, the state of other
    weights, or a state of another kind (DeepSpeed's, a single process's ``optimizer.pt``)."""


def check_fsdp_state(state: FSDPCheckpoint, *, bf16: bool) -> None:
    """Refuse to continue ``state`` in another dtype (its float32 masters belong to a bfloat16
    model, or the other way round). Another world size is fine: DCP reshards.

    Raises:
        FSDPStateError: names ``state.source``, the saved and the current dtype, and how to go on.
    """
    if state.bf16 != bf16:
        saved, now = ("bfloat16" if state.bf16 else "float32"), ("bfloat16" if bf16 else "float32")
        key = "critic.model.dtype" if state.role == "critic" else "policy.dtype"
        raise FSDPStateError(f"{state.source}: this FSDP2 optimizer state was saved by a {saved} model but this "
                             f"update trains a {now} model ({key} changed); keep {key} as it was for this run, or start "
                             "a new run root from this checkpoint's weights")


def init_process_group() -> tuple[int, int]:
    """Initialise torch.distributed for FSDP2 (once per process; an existing group is kept, e.g.
    a resident gang's): nccl on a GPU (this rank's, ``LOCAL_RANK``, made current first), gloo
    on the CPU. Outside torchrun (no ``WORLD_SIZE``) a world of one rank on 127.0.0.1 is set up.
    Needs no DeepSpeed. Returns (rank, world size)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        prepare_rank()
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def layer_classes(model: torch.nn.Module) -> set[str]:
    """The class names of ``model``'s decoder layers: the union of ``_no_split_modules`` of every
    HF ``PreTrainedModel`` inside it (a peft model's base, a critic's backbone), as verl and
    accelerate choose what to wrap."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def shard_model(model: torch.nn.Module, *, mesh, reshard_after_forward: bool, bf16_compute: bool,
                cpu_offload: bool) -> int:
    """Apply ``fully_shard`` to every decoder layer of ``model`` (``layer_classes``), then to the
    root (module docstring), in place. ``bf16_compute``: the sharded float32 parameters are cast to
    bfloat16 for compute (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``);
    otherwise each parameter computes in its own dtype, gradients reduced in float32.
    ``cpu_offload``: FSDP2's ``CPUOffloadPolicy`` (shards and AdamW in CPU memory).

    Returns:
        the number of layers wrapped.
    Raises:
        ValueError: ``model`` has no module of a ``_no_split_modules`` class (not an HF model):
            one root group would gather every weight at once.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    classes = layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"FSDP2: {type(model).__name__} names no decoder layer class (_no_split_modules): "
                         "one fully_shard per layer needs an HF transformers model")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16_compute else None, reduce_dtype=torch.float32)
    # pinned host memory only where there is a GPU to copy to (pinning needs an accelerator)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    # the root's parameters (embeddings, final norm, head) are used last in forward and first in
    # backward: kept gathered in between (FSDP2's default for the root, as torchtitan's)
    fully_shard(model, reshard_after_forward=False, **kw)
    return len(layers)


class FSDPStrategy:
    """FSDP2 data parallelism over the ranks of this job (see the module docstring).

    ``model`` is the sharded module itself (call it like the module); ``full_state_dict()``
    gathers the weights to rank 0 in the dtypes they were loaded in; ``save_state`` writes the
    sharded state that the next update continues (``state``), on any number of ranks.

    Args:
        model: the loaded model (its weights on the CPU or any device; float32, bfloat16, or a
            LoRA model's float32 adapters on a bfloat16 base). With several ranks every rank
            trains on rank 0's weights: the other ranks' model may be on the meta device
            (``weights_on_rank0``), and each receives its shards from rank 0 (``_fill_from_rank0``).
        lr, betas, weight_decay, max_grad_norm: AdamW and clipping (``OptimizerSettings``).
        reshard_after_forward, cpu_offload: ``FSDPConfig``'s.
        state: a saved sharded state to continue (None: AdamW afresh, masters from the weights).
    Raises:
        ValueError: float16 weights (no loss scaling), a model without decoder layer classes, or
            (on every rank) a rank that built another model than rank 0 (``_rank0_weights``).
        FSDPStateError: ``state`` cannot be continued here (``load_state``).
    """

    def __init__(self, model: torch.nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float,
                 max_grad_norm: float, reshard_after_forward: bool = True, cpu_offload: bool = False,
                 state: FSDPCheckpoint | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world_size = init_process_group()
        self._dist = dist
        if any(p.dtype == torch.float16 for p in model.parameters()):
            raise ValueError("FSDP2 with float16 weights needs loss scaling, which is not implemented: use bfloat16")
        # the dtype each weight is saved in (the checkpoint's), before the bfloat16 ones become float32 masters
        self._saved_dtypes = {n: t.dtype for n, t in model.state_dict().items()}
        trainable_bf16 = any(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())
        self.bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # several ranks: rank 0's weights, before the upcast (a bfloat16 model's travel in bfloat16);
        # rank 0 then upcasts in host memory and fully_shard moves one wrapped group at a time to the device
        full = _rank0_weights(model, self.rank) if self.world_size > 1 else None
        if not cpu_offload and full is None:  # one rank: first, so that the float32 copy is made on the device
            model.to(self.device)
        if trainable_bf16:  # the float32 masters: an exact upcast of the loaded bfloat16 weights
            model.to(torch.float32)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.layers = shard_model(model, mesh=self.mesh, reshard_after_forward=reshard_after_forward,
                                  bf16_compute=trainable_bf16, cpu_offload=cpu_offload)
        if full is not None:
            _fill_from_rank0(model, full, rank=self.rank, shards_on=torch.device("cpu") if cpu_offload else self.device,
                             buffers_on=self.device, cpu_offload=cpu_offload)
            del full
        self.model, self.max_grad_norm, self.cpu_offload = model, max_grad_norm, cpu_offload
        self.params = [p for p in model.parameters() if p.requires_grad]
        # foreach AdamW: torch's fused CPU kernel has no DTensor rule on every backend
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        if state is not None:
            self.load_state(state, lr=lr, max_grad_norm=max_grad_norm)

    @property
    def module(self) -> torch.nn.Module:
        """The model (``save_pretrained``, its config): the sharded module itself."""
        return self.model

    def training(self) -> ContextManager[None]:
        """Nothing to switch: FSDP2 casts the float32 shards for compute (mixed precision)."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager[None]:
        """Nothing: the gathered parameters are in their compute dtype already."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        """Drop the sharded gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``world_size * loss`` into the sharded gradients (FSDP2 averages over ranks)."""
        (loss * self.world_size).backward()

    def step(self) -> float:
        """Clip by the global gradient norm (a collective over the ranks' shards), AdamW step on the
        float32 shards (skipped when the norm is not finite); returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        grad_norm = float(norm)
        if torch.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks (on the backend's device, ``collective_device``)."""
        t = torch.tensor(values, dtype=torch.float64, device=collective_device(self._dist.get_backend()))
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM)
        return t.tolist()

    @property
    def lr(self) -> float:
        """Learning rate of the first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self, *, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Every weight of the model gathered on rank 0's CPU (``DTensor.full_tensor`` through
        ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; a collective: call it on
        every rank), each in the dtype it was loaded in (the float32 masters rounded to bfloat16 in
        mixed precision); None on the other ranks. Tied weights (an embedding and the LM head) are
        one tensor under both names, as in the unsharded model, so ``save_pretrained`` writes it
        once, as it does for that model. ``trainable_only``: the parameters that train (a LoRA
        model's adapters: what an adapter sync moves), gathered alone, each by its
        ``DTensor.full_tensor()`` in ``named_parameters`` order on every rank (``get_model_state_dict``
        with ``ignore_frozen_params`` of shards on the device also gathers a frozen weight tied to
        another, such as a LoRA base's tied LM head: the note in ``_sharded_state``); with
        ``cpu_offload`` (shards in host memory, which NCCL does not take) through
        ``get_model_state_dict`` with ``ignore_frozen_params``, which leaves that head out on that
        path (torch 2.13; ``test_an_adapter_gather_takes_the_adapters_alone_not_the_tied_head``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if trainable_only and not self.cpu_offload:
            out = {}
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if p.requires_grad:
                        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                        if self.rank == 0:  # the others only take part in the gather
                            out[n] = full.cpu()
            return out if self.rank == 0 else None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        full = get_model_state_dict(self.model, options=options)
        if self.rank != 0:
            return None
        tied = {n: src for n, src in _first_names(self.model).items() if n != src}  # a later name -> the first
        out = {n: t.to(self._saved_dtypes.get(n, t.dtype)) for n, t in full.items() if n not in tied}
        out.update({n: out[src] for n, src in tied.items() if n in full and src in out})
        return out

    def _sharded_state(self) -> dict:
        """{"model": the trainable parameters' shards (DTensors), "optim": AdamW's sharded state},
        by fully qualified names (``get_state_dict``; frozen weights, a LoRA base, left out)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=True))
        # a frozen weight tied to another (a LoRA base's LM head) passes ignore_frozen_params, which
        # looks at named_parameters() without duplicates (torch/distributed/checkpoint/state_dict.py, 2.13)
        trainable = {n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        return {"model": {k: v for k, v in model_sd.items() if k in trainable}, "optim": optim_sd}

    def save_state(self, folder: str, tag: str = FSDP_TAG) -> None:
        """Write the sharded state (float32 masters and AdamW moments, ``_sharded_state``) with
        ``torch.distributed.checkpoint.save`` into ``folder/tag`` (a collective: every rank writes
        its shards, ``__{rank}_0.distcp``; rank 0 the ``.metadata``). ``folder`` must be one shared
        folder, or one folder per rank that the caller merges."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=os.path.join(folder, tag))

    def load_state(self, state: FSDPCheckpoint, *, lr: float, max_grad_norm: float) -> None:
        """Continue the saved sharded state ``state``: ``torch.distributed.checkpoint.load``
        (resharding a state saved by another number of ranks, which is logged), after checking
        that every loaded master rounds to the weight this update loaded; then this update's
        learning rate and clipping (the other AdamW settings stay the state's). A collective.

        Raises:
            FSDPStateError: another dtype (``check_fsdp_state``), or the state of other weights
                (on every rank).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        check_fsdp_state(state, bf16=self.bf16)
        if state.world_size != self.world_size:
            log.info("FSDP2: %s was saved by %d rank(s); torch.distributed.checkpoint reshards it onto %d rank(s)",
                     state.source, state.world_size, self.world_size)
        sd = self._sharded_state()
        before = {n: _local(t).to(self._saved_dtypes.get(n, t.dtype), copy=True) for n, t in sd["model"].items()}
        dcp.load(sd, checkpoint_id=state.folder)
        mismatched = sum(not torch.equal(_local(t).to(before[n].dtype), before[n]) for n, t in sd["model"].items())
        if int(self.all_reduce_sum([float(mismatched)])[0]):
            raise FSDPStateError(f"{state.source}: this FSDP2 optimizer state holds other weights than the checkpoint "
                                 "this update loaded (its float32 masters do not round to them): it belongs to "
                                 "another checkpoint")
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.max_grad_norm = max_grad_norm

    def barrier(self) -> None:
        """Wait for every rank."""
        self._dist.barrier()


@contextlib.contextmanager
def weights_on_rank0(sharded: bool) -> Iterator[None]:
    """Where an FSDP2 job (``sharded``) loads the model it shards, so that rank 0 alone reads
    its weights: on rank 0 (and on one rank, or without ``sharded``) as it stands; on every
    other rank inside ``rft_core.models.pretrained.meta_shell``, where the loaders build the same
    modules on the meta device and the checkpoint folders are resolved without their weight
    files (``rft_core.stages.checkpoints``: not hashed, not downloaded); the tokenizer and config
    files are read as before. ``FSDPStrategy`` then gives every rank its shards of rank 0's
    weights (``_fill_from_rank0``). Joins the process group first (call it on every rank). The
    weights cross the ranks' interconnect once instead of being read from the run root by every
    rank, and no rank holds the whole model on its GPU (accelerate's ``cpu_ram_efficient_loading``
    and verl's ``fsdp2_load_full_state_dict`` do the same: accelerate/utils/fsdp_utils.py,
    verl/utils/fsdp_utils.py).
    """
    if sharded:
        rank, world_size = init_process_group()
        if world_size > 1:
            _wait_group()  # made now, while every rank is here, not after rank 0's load
            if rank != 0:
                with meta_shell():
                    yield
                return
    yield


# how long the other ranks wait for rank 0 to load the model (NCCL's own default is 10 minutes)
LOAD_WAIT = datetime.timedelta(hours=2)
_WAIT_GROUP: list = []  # [(the default group it was made in, the gloo group)]


def _wait_group():
    """A gloo group of every rank with ``LOAD_WAIT`` as its timeout, made once per default group
    (a collective the first time; a default group destroyed and made again gets a new one): the
    ranks that built a meta model wait in it for rank 0's load, which may take longer than the
    default group's timeout, without holding an NCCL collective."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _WAIT_GROUP or _WAIT_GROUP[0][0] is not world:  # the old world object is held: no reused id
        _WAIT_GROUP[:] = [(world, dist.new_group(backend="gloo", timeout=LOAD_WAIT))]
    return _WAIT_GROUP[0][1]


def _rank0_weights(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0's ``model.state_dict()`` (every name, a tied weight under both; empty on the other
    ranks), after checking that every rank holds the same modules: the same names, shapes,
    dtypes and trainable flags, the same tied weights and the same buffers (a collective over
    ``_wait_group``).

    Raises:
        ValueError: on every rank, naming the names that differ from rank 0's (a model another
            rank built otherwise, e.g. other code or another transformers version; or a
            checkpoint whose LM head differs from its embedding although its config ties them,
            which transformers loads untied on rank 0 while the other ranks build them tied).
    """
    import torch.distributed as dist

    group = _wait_group()
    layouts: list = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, _layout(model), group=group)
    odd = next(((r, other) for r, other in enumerate(layouts) if other != layouts[0]), None)
    if odd is not None:
        r, other = odd
        only0, only_r = sorted(set(layouts[0]) - set(other))[:3], sorted(set(other) - set(layouts[0]))[:3]
        ties = {e[:5] for e in only0} == {e[:5] for e in only_r}  # the same weights, tied otherwise
        why = ("rank 0 loaded weights untied that the config ties (the checkpoint holds other values for them: "
               "transformers unties them); set tie_word_embeddings: false in its config.json"
               if ties else "every rank must run the same code and transformers version on the same checkpoint")
        raise ValueError(f"FSDP2: rank {r} built another model than rank 0: rank 0 has {only0}, rank {r} has "
                         f"{only_r}; {why}")
    return model.state_dict() if rank == 0 else {}


def _layout(model: torch.nn.Module) -> list[tuple]:
    """What ranks must agree on before rank 0's weights are shared: (name, shape, dtype,
    requires_grad) of every parameter (tied ones under each name, with the first name they
    share), and (name, shape, dtype) of every buffer."""
    first = _first_names(model)
    params = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad, first[n])
              for n, p in model.named_parameters(remove_duplicate=False)]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers(remove_duplicate=False)]
    return params + buffers


def _first_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name of ``model`` (a tied weight under each of its names) -> the first
    name of the same parameter in ``named_parameters`` order (itself unless tied to an earlier one)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _fill_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor], *, rank: int, shards_on: torch.device,
                     buffers_on: torch.device, cpu_offload: bool) -> None:
    """Give every rank of the sharded ``model`` its shards of rank 0's weights ``full`` and rank
    0's buffers (a collective). The other ranks' tensors (meta, from ``weights_on_rank0``) are
    first made real on ``shards_on`` (``to_empty``), so that torch copies each shard in place,
    which keeps the parameters' dtypes (a bfloat16 weight into its float32 master, exactly) and a
    tied embedding and LM head one parameter; then ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` (torch/distributed/checkpoint/state_dict.py, 2.13: one whole
    tensor at a time over the group's device, each rank keeping its slice; it refuses tensors on
    several devices, so the buffers wait on ``shards_on``); then every buffer from rank 0 by name
    (a buffer two modules share is one tensor on rank 0 but two after ``to_empty``), since the
    non-persistent ones (a rotary embedding's ``inv_freq``) are in no state dict (verl's
    ``fsdp2_load_full_state_dict`` does the same), ending on ``buffers_on`` (where ``fully_shard``
    put rank 0's).

    Raises:
        RuntimeError: a tensor still on the meta device afterwards (a name rank 0's weights lack).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if rank != 0:
        model.to_empty(device=shards_on)
    named = [(m, name) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    for m, name in named:
        m._buffers[name] = m._buffers[name].to(shards_on)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               cpu_offload=cpu_offload, strict=True))
    on = collective_device(dist.get_backend())
    for m, name in named:  # the same order on every rank: modules() and each module's buffers are ordered
        t = m._buffers[name].to(on)
        dist.broadcast(t, src=0)
        m._buffers[name] = t.to(buffers_on)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise RuntimeError("FSDP2: a weight is still on the meta device after rank 0's weights were shared")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor: itself)."""
    return t.to_local() if hasattr(t, "to_local") else t
