"""What a trained policy hands to its inference copies and to recovery: its weights as an
inference model holds them (LoRA adapters merged, ZeRO partitions or FSDP2 shards gathered),
whose weight digest (``rft_core.weightsync.digest``) a weightless update records and recovery
checks (``rft_core.stages.lineage.trained_digest``). Imported by the update stage program and the
resident workers alike (no Ray, no Prefect)."""
from __future__ import annotations

import copy
import sys

import torch

from rft_core.training.strategy import DeepSpeedStrategy, FSDPStrategy
from rft_core.weightsync.plan import state_tensors

# the strategies whose weights are sharded over ranks: gathered to rank 0 (``full_state_dict``, a collective)
SHARDED = (DeepSpeedStrategy, FSDPStrategy)


def inference_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the trained ``model`` as an inference copy of the policy holds them: its
    ``state_tensors``; for a peft LoRA model, the base weights with the adapters merged in, by
    peft's own ``merge_and_unload`` on a copy (the trainer keeps its adapters), which in float32
    is what a stage-mode inference pass computes from the adapter checkpoint (``load_causal_lm``
    merges on load in float32; the float32 adapters round-trip the checkpoint exactly), so a
    float32 resident LoRA run is bit-identical to a stage-mode one; below float32 stage mode keeps
    the adapters unmerged and the resident rollout worker's merged copy differs by the rounding
    (docs/scale.md, "LoRA in bfloat16"). The copy costs one more model in memory during a sync.
    A process that never imported peft holds no peft model, so peft (~0.4 s to import) is not
    imported to ask."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return state_tensors(model)
    with torch.no_grad():
        merged = copy.deepcopy(model).merge_and_unload()
    return state_tensors(merged)


def strategy_device(strategy) -> torch.device:
    """The device a trainer computes on (a ZeRO-3 parameter is empty outside a gather: its
    partition's device; FSDP2: its mesh's device, also when its shards sit in CPU memory)."""
    if isinstance(strategy, FSDPStrategy):
        return strategy.device
    p = next(strategy.model.parameters())
    return getattr(p, "ds_tensor", p).device


def trained_tensors(strategy) -> dict[str, torch.Tensor] | None:
    """The trained policy's weights as an inference copy holds them: ``inference_tensors`` of a
    single-process trainer's model; under DeepSpeed or FSDP2 ``strategy.full_state_dict()`` (a
    collective: every rank calls it; ZeRO-3 gathers the partitions, FSDP2 every shard's
    ``DTensor.full_tensor()`` onto rank 0's CPU) on rank 0 and None on the other ranks,
    tied weights under their first name only (as ``state_tensors``: by parameter identity, since
    a ZeRO-3 parameter has no storage of its own outside a gather). Where they are: the model's
    device, except under ZeRO-3, whose consolidated state dict is on the CPU
    (``param.detach().cpu()``, deepspeed/runtime/engine.py 0.19.8); a sync packs them onto its
    backend's device bucket by bucket (``rft_core.weightsync.plan.sync_device``)."""
    if not isinstance(strategy, SHARDED):
        return inference_tensors(strategy.model)
    full = strategy.full_state_dict()
    if strategy.rank != 0:
        return None
    module, seen, names = strategy.module, set(), []
    for name, v in module.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            names.append(name)
    return {n: full[n].detach() for n in names}
