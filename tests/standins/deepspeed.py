"""A DeepSpeed ZeRO-3 rank as the resident policy worker sees it, without GPUs or a process group.

Copied behaviour (DeepSpeed 0.19.8, ``deepspeed/runtime/engine.py``,
``DeepSpeedEngine._zero3_consolidated_16bit_state_dict``): the consolidated state dict is built
layer by layer under ``GatheredParameters`` and every tensor is stored as
``param.detach().cpu()`` (buffers ``buf.detach().cpu()``): it lands **on the CPU**, on rank 0
only (``None`` on the other ranks); a parameter shared by two modules (``param.ds_id`` equal: a
tied embedding) is stored once and the second name points at the same tensor. Outside a gather a
ZeRO-3 parameter's own storage is empty and its partition ``param.ds_tensor`` lives on the rank's
device (``cuda:<local rank>`` under NCCL).

What is not modelled: the partitioning itself (every rank here holds the whole model; the stand-in
only says where the partition would live), and the collective the gather is (no other rank has
to call in).
"""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import torch

from rft_core.training.strategy import DeepSpeedStrategy


class Zero3Engine:
    """``strategy.model`` of a ZeRO-3 ``DeepSpeedStrategy``: ``module`` (the HF model) and the
    consolidated export of DeepSpeed 0.19.8 (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, rank: int, device: torch.device) -> None:
        self.module, self.rank = module, rank
        for p in module.parameters():  # the partition's device (a ZeRO-3 parameter has no storage of its own)
            p.ds_tensor = SimpleNamespace(device=device)
        self.exports = 0

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """engine.py's export: CPU tensors on rank 0, None elsewhere, shared parameters once."""
        self.exports += 1
        if self.rank != 0:
            return None
        state: OrderedDict[str, torch.Tensor] = OrderedDict()
        shared: dict[int, str] = {}

        def layer(module: torch.nn.Module, prefix: str = "") -> None:
            for name, param in module.named_parameters(recurse=False):
                if param is None or (exclude_frozen_parameters and not param.requires_grad):
                    continue
                key = prefix + name
                if id(param) in shared:  # param.ds_id
                    state[key] = state[shared[id(param)]]
                else:
                    state[key] = param.detach().cpu()
                    shared[id(param)] = key
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    state[prefix + name] = buf.detach().cpu()
            for name, child in module.named_children():
                layer(child, prefix + name + ".")

        layer(self.module)
        return state


def zero3_strategy(module: torch.nn.Module, *, rank: int = 0, world_size: int = 2,
                   device: torch.device | str = "cuda:0") -> DeepSpeedStrategy:
    """A ``DeepSpeedStrategy`` (the project's class, its ``full_state_dict`` and all) of ZeRO
    stage 3 whose engine is ``Zero3Engine`` on ``device``: rank ``rank`` of ``world_size``."""
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.rank, strategy.world_size, strategy.zero_stage, strategy.bf16 = rank, world_size, 3, False
    strategy.model = Zero3Engine(module, rank=rank, device=torch.device(device))
    return strategy
