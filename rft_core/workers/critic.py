"""The critic's resident worker (``CriticWorker``): runs ``critic_values`` on the trained critic
it holds and ``critic_update`` by continuing its training strategy (model and AdamW state) in
memory. The critic still commits its weights and AdamW state every iteration
(``checkpoint.every`` concerns the policy), so its files equal stage mode's; what it saves is
the two loads per iteration (a sharded critic's gang saves the update's load of its weights and
sharded AdamW state; its values pass still loads, below).

A DeepSpeed or FSDP2 critic (``critic.deepspeed``, ``critic.fsdp``) is a gang of
``orchestration.critic_ranks`` ranks, one Ray actor each, as the policy trainer's: every rank
runs both programs. The update is the sharded update stage mode runs under torchrun. The values
pass runs on rank 0 alone, on the critic loaded from storage as stage mode does (the other ranks
return None): a forward through the held FSDP2 module gathers its shards into buffers laid out
apart from a loaded model's, and its values differed from stage mode's in the last float32 bit
(2.4e-7 on the tiny test critic), so the gang keeps stage mode's values exact and pays one load
per values pass (``tests/rft_core/training/chain.py::resident_critic_gang``)."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from rft_core.heap import collect_all
from rft_core.models.hub import torch_dtype
from rft_core.stages.sources import critic_model, models_from, version_key
from rft_core.training.strategy import SingleProcess, continue_with
from rft_core.workers.base import ResidentWorker
from schemas import PolicyRef


class CriticWorker(ResidentWorker):
    """The critic's worker (see the module docstring).

    ``version``: the critic version (``version_key``: the initial critic's path, or the committed
    ``critic_update``) that the kept strategy ``held`` holds; None before the first update.

    Args:
        pool, rank, ranks, threads, keep_device_cache, freeze_heap: ``ResidentWorker``'s.
    """

    role: ClassVar[str] = "critic"
    programs: ClassVar[tuple[str, ...]] = ("critic_values", "critic_update")

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True, freeze_heap: bool = False) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache,
                         freeze_heap=freeze_heap)
        self.held: Any = None  # its training strategy (model and AdamW state)

    def critic_model(self, ref: PolicyRef, *, dtype: str) -> torch.nn.Module | None:
        """``ModelSource.critic_model``: the trained critic this worker holds when it holds
        ``ref`` in ``dtype`` in one process (eval mode), else on rank 0 the critic loaded from
        storage (not kept: the update builds its own strategy; a sharded critic's gang always
        loads, see the module's docstring) and None on the other ranks (they take no part)."""
        held = self.held
        if isinstance(held, SingleProcess) and self.version == version_key(ref) and \
                next(held.model.parameters()).dtype == torch_dtype(dtype):
            return held.model.eval()
        if self.rank:
            return None
        with models_from(None):  # storage
            return critic_model(ref, dtype=dtype)

    def critic_strategy(self, ref: PolicyRef, build: Callable[[], Any], *, lr: float, max_grad_norm: float):
        """``ModelSource.critic_strategy``: the kept strategy when it holds ``ref`` (continued
        with ``lr`` and ``max_grad_norm``), else ``build()`` (from storage), kept from now on."""
        if self.held is None or self.version != version_key(ref):
            if self.held is not None:  # the old strategy is freed before the new one is loaded
                self.held = None
                collect_all()  # its cycles too, if it was frozen (rft_core.heap)
            self.held, self.version = build(), version_key(ref)
            return self.held
        continue_with(self.held, lr=lr, max_grad_norm=max_grad_norm)
        return self.held

    def critic_trained(self, ref: PolicyRef) -> None:
        """``ModelSource.critic_trained``: the kept strategy now holds ``ref``."""
        self.version = version_key(ref)
