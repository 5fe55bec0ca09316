"""What a trained policy hands to its inference copies and to recovery: its weights as an
inference model holds them (LoRA adapters merged, ZeRO partitions or FSDP2 shards gathered),
whose weight digest (``rft_core.weightsync.digest``) a weightless update records and recovery
checks (``rft_core.stages.lineage.trained_digest``). Imported by the update stage program and the
resident workers alike (no Ray, no Prefect)."""
from __future__ import annotations

import copy

import torch

from rft_core.models.lora import is_peft_model, merge_state
from rft_core.training.strategy import DeepSpeedStrategy, FSDPStrategy
from rft_core.weightsync.plan import WeightSyncError, state_tensors

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
    (docs/scale.md, "LoRA in bfloat16"). The copy costs one more model in memory during a sync."""
    if not is_peft_model(model):
        return state_tensors(model)
    with torch.no_grad():
        merged = copy.deepcopy(model).merge_and_unload()
    return state_tensors(merged)


def adapter_tensors(model: torch.nn.Module, gathered: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The LoRA adapters of the peft ``model``: its ``state_tensors`` (or of ``gathered``: its
    state-dict tensors gathered from the ranks of a sharded trainer) under the adapter layers
    of its tuner layers (each ``BaseTunerLayer``'s ``adapter_layer_names``: ``lora_A``,
    ``lora_B``, and ``lora_embedding_A/B`` for an adapted embedding), found structurally as peft's
    own ``BaseTuner._mark_only_adapters_as_trainable`` finds them (peft/tuners/tuners_utils.py,
    0.21.2), under the model's state-dict names and as views of its parameters, so that a sync
    lands in them in place: what an adapter sync moves (``Meet.adapters``) when the receiving copy
    keeps the adapters on a base of its own (``rft_core.models.lora.keeps_adapters``). The
    trainer's are float32 (peft's ``autocast_adapter_dtype``), whatever the base's dtype.

    Raises:
        WeightSyncError: ``model`` holds no LoRA adapter (not a peft model), or it trains a
            parameter outside them (peft's ``modules_to_save``, a bias with ``bias`` other than
            "none", trainable tokens: an adapter from elsewhere given as ``policy.path``), which an
            adapter sync would leave behind in the receiving copy; a copy (no parameter trains)
            has none."""
    prefixes: tuple[str, ...] = ()
    if is_peft_model(model):
        from peft.tuners.tuners_utils import BaseTunerLayer  # imported (is_peft_model): a lookup, no import cost

        prefixes = tuple(f"{name}.{layer}." for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)
                         for layer in m.adapter_layer_names)
    source = state_tensors(model) if gathered is None else gathered
    tensors = {n: t for n, t in source.items() if n.startswith(prefixes)} if prefixes else {}
    if not tensors:
        raise WeightSyncError(f"an adapter sync was asked of a {type(model).__name__}, which holds no LoRA adapter "
                              "(update.lora is not set for this policy)")
    outside = [n for n, p in model.named_parameters() if p.requires_grad and n not in tensors]
    if outside:
        raise WeightSyncError(f"the policy trains {len(outside)} parameter(s) outside its LoRA layers ({outside[:3]}: "
                              "peft's modules_to_save, a trained bias or trainable tokens), which a sync of the "
                              "adapters would not carry; train in float32, or in stage mode, or with an adapter of "
                              "LoRA layers only")
    return tensors


def trained_adapters(strategy) -> dict[str, torch.Tensor] | None:
    """The trained LoRA adapters (``adapter_tensors``) of a single-process or FSDP2 trainer, what
    an adapter sync moves: under FSDP2 gathered alone onto rank 0's CPU
    (``FSDPStrategy.full_state_dict(trainable_only=True)``, a collective: every rank calls it;
    None on the ranks above 0), under the names of the unsharded peft model (FSDP2 keeps them).

    Raises:
        WeightSyncError: ``adapter_tensors``'s; a DeepSpeed trainer (its bf16 mode casts every
            parameter, the adapters too, to bfloat16: ``_cast_module_mixed_precision``,
            deepspeed/runtime/engine.py 0.19.8; ``resident_blockers`` refuses the config first)."""
    if isinstance(strategy, DeepSpeedStrategy):
        raise _deepspeed_lora("an adapter sync")
    if not isinstance(strategy, FSDPStrategy):
        return adapter_tensors(strategy.model)
    gathered = strategy.full_state_dict(trainable_only=True)
    return None if gathered is None else adapter_tensors(strategy.module, gathered)


def merged_tensors(strategy) -> dict[str, torch.Tensor] | None:
    """What a sync of full weights sends (an inference copy that does not keep a LoRA policy's
    adapters): ``trained_tensors``, except for an FSDP2 peft LoRA trainer, whose gathered state
    (``full_state_dict``, a collective: every rank calls it; base and adapters under their peft
    names) is merged on rank 0's CPU by ``rft_core.models.lora.merge_state`` (peft's safe merge on
    a meta-device twin given the gathered tensors, which on one rank may be the trainer's own):
    what a single-process trainer's ``inference_tensors`` and stage mode's merged load compute,
    bit for bit in float32 on one device; None on the ranks above 0. Its cost on the CPU: about
    2 x rank x (the adapted weights' elements) multiply-adds per sync.

    Raises:
        WeightSyncError: a DeepSpeed LoRA trainer (its bf16 mode casts the adapters to bfloat16:
            ``trained_adapters``; ``resident_blockers`` refuses the config first)."""
    if not isinstance(strategy, SHARDED) or not is_peft_model(strategy.module):
        return trained_tensors(strategy)
    if isinstance(strategy, DeepSpeedStrategy):
        raise _deepspeed_lora("a merged sync")
    full = strategy.full_state_dict()
    return None if full is None else state_tensors(merge_state(strategy.module, full))


def _deepspeed_lora(what: str) -> WeightSyncError:
    """The refusal of ``what`` from a DeepSpeed LoRA trainer (see ``trained_adapters``)."""
    return WeightSyncError(f"{what} from a DeepSpeed LoRA trainer is not implemented (update.deepspeed with "
                           "update.lora under resident workers is refused: TrainConfig.resident_blockers)")


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
