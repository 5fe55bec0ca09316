"""The engine transports (``vllm``, ``sglang``): a weight sync into a GPU engine's own loader.

The engine (``VLLMEngine``, ``SGLangEngine``; this package does not import them) is the landing
(``rft_core.weightsync.landing.IntoEngine``): ``engine.receive_weights(plan, meet, *, timeout_s)
-> SyncReport`` joins the collective transaction (``rft_core.weightsync.collective.receive_buckets``:
every vLLM tensor-parallel worker as one rank; SGLang in the engine's process, rank 1 of 2) and
hands each bucket's tensors to the engine's loader, which maps HF names to its fused, sharded
parameters. The sender's leg is the collective of the sender's backend (``meet.backend``: gloo
or NCCL). The engine also provides ``sync_world_size``, ``sync_dtype``, ``invalidate_weights()``
and ``weights_version``; it refuses a plan that does not fit its model at the transaction's plan
check (``SyncedWeights.plan_refusal``), so the sender fails at once too and nothing lands. Until
the session has verified the digests the engine's weights count as invalid: an engine that
failed a sync serves nothing until a sync or a checkpoint load succeeds.
"""
from __future__ import annotations

from typing import Mapping

import torch

from rft_core.weightsync.base import Meet, Transport, register
from rft_core.weightsync.collective import COLLECTIVES
from rft_core.weightsync.landing import IntoEngine, Landing
from rft_core.weightsync.plan import SyncPlan, SyncReport


class EngineTransport(Transport):
    """Into a GPU engine over the sender's collective backend (see the module docstring)."""

    device = "the engine's GPU(s); the sender's backend (gloo or NCCL)"

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Rank 0: the collective of ``meet.backend`` (``Gloo``/``NCCL.send``) to the engine's ranks."""
        return COLLECTIVES[meet.backend](timeout_s=self.timeout_s).send(tensors, plan, meet)

    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """The engine's ``receive_weights`` (recording ``meet.version`` as what its weights hold),
        its whole wait under ``timeout_s``.

        Raises:
            TypeError: a landing that is not an engine.
            WeightSyncError: the engine's receive failed (it is then invalid; a dead one is closed).
        """
        if not isinstance(landing, IntoEngine):
            raise TypeError(f"the {self.name} transport lands in an engine, not in {type(landing).__name__}")
        return landing.engine.receive_weights(plan, meet, timeout_s=self.timeout_s)


@register
class VLLMTransport(EngineTransport):
    """Into a vLLM engine's workers (each tensor-parallel worker one receiving rank)."""

    name = "vllm"
    upstream = ("vllm/v1/executor/multiproc_executor.py (LLM.collective_rpc into WeightReloadExtension), "
                "the model's load_weights (e.g. vllm/model_executor/models/llama.py)")


@register
class SGLangTransport(EngineTransport):
    """Into an SGLang engine (one receiving rank in the engine's process)."""

    name = "sglang"
    upstream = "python/sglang/srt/entrypoints/engine.py (Engine.update_weights_from_tensor)"
