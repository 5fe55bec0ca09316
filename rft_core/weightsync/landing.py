"""Where a weight sync's bytes land: what differs per receiver, whichever transport moves them.

- ``IntoTensors``: a model's own tensors (a resident rollout worker's HF copy,
  ``rft_core.weightsync.plan.state_tensors``), each tensor copied in place as it arrives and
  added to the landed digest;
- ``IntoEngine``: a GPU engine (``VLLMEngine``, ``SGLangEngine``; this package does not import
  them) whose own loader takes the buckets (its ``receive_weights``: the vLLM worker extension,
  SGLang's ``update_weights_from_tensor``), mapping HF names onto its fused, sharded parameters.

A landing is invalid from the moment bytes may move (``invalidate``) until the session has
verified the landed digest; a sync that fails leaves it invalid (the rollout worker holds no
version, the engine serves nothing) until a sync or a checkpoint load succeeds.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Protocol

import torch

from rft_core.weightsync.digest import Digest
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError, bucket_views


class Landing(ABC):
    """What a sync lands in (see the module docstring).

    Attributes:
        dtype: the dtype it holds floating weights in (the plan's; the sender casts to it).
        world_size: 1 + its receiving ranks (an engine's tensor-parallel workers; else 2).
        device: where its tensors are (None: an engine's own devices).
        engine_kind: the engine's transport (``"vllm"``, ``"sglang"``), None for tensors.
        offer_dtype: the dtype in which the sender must offer its plan (a receiver without
            HF-named tensors of its own to plan from: an engine), or None.
        what: the landing in messages.
        adapters: it takes a LoRA policy's adapters only (``Meet.adapters``), not every weight.
    """

    dtype: str
    world_size: int = 2
    device: torch.device | None = None
    engine_kind: str | None = None
    offer_dtype: str | None = None
    what: str = ""
    adapters: bool = False

    @abstractmethod
    def plan(self, offered: str | None, bucket_mb: float) -> SyncPlan:
        """The transaction's plan: the receiver's own, or the sender's ``offered`` (its JSON).

        Raises:
            WeightSyncError: the offered plan is missing or does not suit this landing.
        """

    @abstractmethod
    def invalidate(self) -> None:
        """Hold what this landing holds as invalid (bytes may be moving, or a sync failed)."""


class IntoTensors(Landing):
    """A model's own tensors (name -> tensor, e.g. ``state_tensors(model)``): a resident HF copy.

    Args:
        target: the tensors written in place (every tensor of the plan, none more).
        dtype: the model's dtype name (the meet's: what the sender casts floating weights to);
            None: its first floating tensor's.
        on_invalid: called by ``invalidate`` (the worker forgets the version its copy holds).
        adapters: ``target`` is a LoRA model's adapters (``rft_core.weightsync.trained.adapter_tensors``),
            the sender's adapters are asked for (``Meet.adapters``).
    """

    def __init__(self, target: Mapping[str, torch.Tensor], dtype: str | None = None, *,
                 on_invalid: Callable[[], None] | None = None, adapters: bool = False) -> None:
        if not target:
            raise ValueError("a sync lands in a model with at least one tensor")
        floating = [t.dtype for t in target.values() if t.is_floating_point()]
        self.dtype = dtype or str(floating[0] if floating else torch.float32).removeprefix("torch.")
        self.target, self._on_invalid, self.adapters = target, on_invalid, adapters
        self.what = " of the LoRA adapters" if adapters else ""
        self.device = next(iter(target.values())).device

    def plan(self, offered: str | None, bucket_mb: float) -> SyncPlan:
        """The plan of the target's own tensors in buckets of ``bucket_mb`` MiB (the sender makes
        its own from its weights in ``dtype``; their fingerprints must agree)."""
        return SyncPlan.of(self.target, bucket_mb=bucket_mb)

    def invalidate(self) -> None:
        """``on_invalid()``."""
        if self._on_invalid is not None:
            self._on_invalid()

    def put(self, name: str, src: torch.Tensor, digest: Digest) -> None:
        """Copy ``src`` (the arriving tensor ``name``, any device and dtype) into the target's
        tensor and add the landed tensor to ``digest`` (``Digest.copy_into``: on the CPU piece by
        piece on its threads, each piece hashed right after its copy; done by ``hexdigest``).
        ``src`` must stay as it is until then."""
        digest.copy_into(name, self.target[name], src)

    def land(self, plan: SyncPlan, index: int, buf: torch.Tensor, digest: Digest) -> None:
        """Land bucket ``index`` of ``plan``, held in the flat uint8 ``buf`` (``put`` each tensor)."""
        for name, src in bucket_views(plan, buf, index):
            self.put(name, src, digest)


class SyncedEngine(Protocol):
    """What an engine provides as a landing (``rft_core.engines.SyncedWeights``)."""

    sync_transport: str
    sync_dtype: str
    sync_world_size: int

    def receive_weights(self, plan: SyncPlan, meet: Any, *, timeout_s: float) -> SyncReport:
        """Join the sync as the receiving ranks and load every bucket (the engine's own loader)."""

    def invalidate_weights(self) -> None:
        """Serve nothing until a sync or a checkpoint load succeeds."""


def check_buckets(plan: SyncPlan, bucket_mb: float) -> None:
    """Raise ``WeightSyncError`` when a bucket of several tensors exceeds ``bucket_mb`` MiB (the
    receiving device holds one bucket at a time; one tensor larger than that is its own bucket)."""
    limit = int(bucket_mb * 2**20)
    for i, size in enumerate(plan.bucket_sizes):
        if size > limit and len(plan.bucket(i)) > 1:
            raise WeightSyncError(f"the sender's sync plan has a bucket of {size / 2**20:.1f} MiB holding several "
                                  f"tensors, over this worker's {bucket_mb:g} MiB (sync_bucket_mb differs)")


class IntoEngine(Landing):
    """A GPU engine's loader (see the module docstring): the sender offers the plan in the
    engine's dtype (``sync_dtype``), the engine's transport moves it (``sync_transport``).

    Raises:
        ValueError: a LoRA engine (its ``sync_world_size``), at once: before anything starts.
    """

    what = " into the engine"

    def __init__(self, engine: SyncedEngine) -> None:
        self.world_size = engine.sync_world_size
        self.engine = engine
        self.dtype = self.offer_dtype = engine.sync_dtype
        self.engine_kind = engine.sync_transport

    def plan(self, offered: str | None, bucket_mb: float) -> SyncPlan:
        """The sender's offered plan, refused when a bucket of several tensors exceeds this
        worker's ``bucket_mb`` (``check_buckets``)."""
        if offered is None:
            raise WeightSyncError("the policy worker's offer has no sync plan (it was asked for the engine's dtype)")
        plan = SyncPlan.from_json(offered)
        check_buckets(plan, bucket_mb)
        return plan

    def invalidate(self) -> None:
        """The engine's ``invalidate_weights``."""
        self.engine.invalidate_weights()
