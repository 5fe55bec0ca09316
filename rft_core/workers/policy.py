"""The policy trainer's resident worker (``PolicyWorker``): runs ``ppo_update``, keeps the
policy's model, float32 master weights and AdamW (or ZeRO) state in memory across iterations,
and is the sender of every weight sync to the rollout engine (``prepare_weights``,
``send_weights``, ``export_weights``). Under DeepSpeed or FSDP2 it is a gang of
``orchestration.policy_ranks`` ranks, one Ray actor each; its sync methods are collectives (a
ZeRO-3 gather, FSDP2's ``DTensor.full_tensor()`` of every shard, a rebuild) that every rank runs,
rank 0 holding the gathered weights and sending them.

A trainer that was never written (``checkpoint.every`` > 1) and is not in memory (a new or
restarted worker) is rebuilt exactly by ``rft_core.stages.recovery.rebuild_trainer`` (its base
checkpoint loaded with its AdamW state, the committed updates after it re-applied).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from rft_core.config import WorkersConfig
from rft_core.counters import count
from rft_core.network import free_port
from rft_core.stages.lineage import has_weights
from rft_core.stages.optimizer_state import wait_for_optimizer_writes
from rft_core.stages.recovery import rebuild_trainer
from rft_core.stages.sources import version_key
from rft_core.stages.update import configure_trainer
from rft_core.weightsync.choose import device_id, group_backend, transport
from rft_core.weightsync.collective import host_address
from rft_core.weightsync.plan import SyncPlan, WeightSyncError, sync_device
from rft_core.weightsync.trained import strategy_device, trained_tensors
from rft_core.workers.base import FanOut, ResidentWorker, fan_out
from schemas import PolicyRef


class PolicyWorker(ResidentWorker):
    """One rank of the policy trainer (see the module docstring).

    ``version``: the policy version (``version_key``) the trainer ``held`` holds: the update it
    last ran or was rebuilt to; None before its first update.

    Args:
        pool, rank, ranks, threads, keep_device_cache: ``ResidentWorker``'s.
        sync_timeout_s, sync_bucket_mb: the weight-sync transaction's limits.
    """

    role: ClassVar[str] = "policy"
    programs: ClassVar[tuple[str, ...]] = ("ppo_update",)

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True,
                 sync_timeout_s: float = 300.0, sync_bucket_mb: int = 256) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache)
        self.sync_timeout_s, self.sync_bucket_mb = sync_timeout_s, sync_bucket_mb
        self.held: Any = None  # the rft_core.stages.update.PolicyTrainer it keeps
        self._ipc = transport("cuda_ipc", timeout_s=sync_timeout_s)  # what export_weights shares
        self._prepared: tuple[str | None, Any] | None = None  # (version, tensors) of a prepared sync

    @classmethod
    def kwargs_from(cls, workers: WorkersConfig) -> dict[str, Any]:
        """``ResidentWorker.kwargs_from`` and the sync's limits."""
        return {**super().kwargs_from(workers), "sync_timeout_s": workers.sync_timeout_s,
                "sync_bucket_mb": workers.sync_bucket_mb}

    # -- ModelSource: the trainer ------------------------------------------------------------
    def trainer(self, inp):
        """``ModelSource.trainer``: the trainer holding ``inp.policy``, with this update's
        learning rate and clipping."""
        trainer = self._ensure_trainer(inp.policy, inp)
        configure_trainer(trainer, inp.update)
        return trainer

    def trained(self, ref: PolicyRef) -> None:
        """``ModelSource.trained``: the trainer now holds ``ref`` (weights kept for a sync of the
        version before are dropped)."""
        self.version, self._prepared = version_key(ref), None

    def _ensure_trainer(self, ref: PolicyRef, inp=None):
        """The trainer holding ``ref``: the one kept in memory, or rebuilt (its base checkpoint
        loaded, the committed updates after it re-applied)."""
        key = version_key(ref)
        if self.held is None or self.version != key:
            self.held = None
            trainer, report = rebuild_trainer(ref, inp)
            count("recovered_updates", report["replayed"])
            self.held, self.version = trainer, key
        return self.held

    @fan_out(FanOut.EACH)
    def close(self) -> None:
        """Finish this rank's pending background writes (the optimizer state and, for a resident
        checkpoint iteration, the weights: ``rft_core.stages.optimizer_state``) before the worker
        is stopped.

        Raises:
            OptimizerStateError: a write failed (resuming the run recomputes that state).
        """
        wait_for_optimizer_writes()

    # -- the sending side of a weight sync ---------------------------------------------------
    @fan_out(FanOut.COLLECTIVE)
    def prepare_weights(self, ref: PolicyRef, dtype: str | None = None) -> dict[str, Any]:
        """Get ready to send ``ref``'s weights: ``{"status": "storage"}`` when this worker does
        not hold ``ref`` and ``ref`` has its weights on storage (the receiver loads them there:
        a resume), else rebuild it if needed and return where to meet (``addr``, ``port``) and
        this worker's device (``device``: same GPU means CUDA IPC instead of a process group).
        With ``dtype`` (a receiver without an HF-named copy of the model of its own: a vLLM or
        SGLang engine) the answer also has ``plan``: the sync plan in that dtype
        (``SyncPlan.to_json``)."""
        if (self.held is None or self.version != version_key(ref)) and (
                isinstance(ref, str) or has_weights(ref)):
            return {"status": "storage"}
        trainer = self._ensure_trainer(ref)
        device = strategy_device(trainer.strategy)
        ready = {"status": "ready", "addr": host_address(), "port": free_port(), "device": device_id(device),
                 "backend": group_backend(device)}
        if dtype is not None:
            tensors = self._send_tensors(keep=True)  # the send that follows uses them: one gather, one merge
            if tensors is not None:
                ready["plan"] = SyncPlan.of(tensors, dtype=dtype, bucket_mb=self.sync_bucket_mb).to_json()
        return ready

    def _send_tensors(self, *, keep: bool = False) -> dict[str, torch.Tensor] | None:
        """The policy's weights as an inference copy holds them (``inference_tensors``); under
        DeepSpeed gathered from the ranks (a collective: every rank calls it), on rank 0 only
        (None on the others). ``keep``: hold them for the next call (a ``prepare_weights`` whose
        plan needs them, then its ``send_weights``), which takes them; a ZeRO-3 gather or a LoRA
        merge then runs once per sync."""
        kept, self._prepared = self._prepared, None
        if kept is not None and kept[0] == self.version:
            tensors = kept[1]
        else:
            tensors = trained_tensors(self.held.strategy)
        if keep:
            self._prepared = (self.version, tensors)
        return tensors

    def _check_holds(self, ref: PolicyRef) -> None:
        if self.version != version_key(ref):
            raise WeightSyncError(f"the policy worker holds {self.version}, not {version_key(ref)}")

    def _held_plan(self, ref: PolicyRef, dtype: str) -> tuple[dict[str, torch.Tensor], SyncPlan] | None:
        """``ref``'s weights to send (``_send_tensors``) and their plan in ``dtype``; None on a
        DeepSpeed rank above 0 (it took part in the gather).

        Raises:
            WeightSyncError: this worker does not hold ``ref``.
        """
        self._check_holds(ref)
        tensors = self._send_tensors()
        return None if tensors is None else (tensors, SyncPlan.of(tensors, dtype=dtype, bucket_mb=self.sync_bucket_mb))

    @fan_out(FanOut.COLLECTIVE)
    def tensors(self, ref: PolicyRef) -> dict[str, torch.Tensor] | None:
        """``ref``'s weights (held after ``prepare_weights``) for a receiver in this process (the
        ``local`` transport): ``_send_tensors``' answer.

        Raises:
            WeightSyncError: this worker does not hold ``ref``.
        """
        self._check_holds(ref)
        return self._send_tensors()

    @fan_out(FanOut.COLLECTIVE)
    def send_weights(self, ref: PolicyRef, *, addr: str, port: int, dtype: str, backend: str,
                     world_size: int = 2) -> dict[str, Any]:
        """Rank 0 of the sync of ``ref`` (held after ``prepare_weights``) to ``world_size - 1``
        receivers in ``dtype``, packed bucket by bucket on the backend's device
        (``sync_device``: this rank's GPU for NCCL, wherever the weights are: DeepSpeed ZeRO-3
        gathers them to the CPU); returns the sender's report (``checksum``, and the same value
        as ``digest``, of the weights as sent). The other ranks of a DeepSpeed gang take part in
        the gather and return ``{}``.

        Raises:
            WeightSyncError: this worker does not hold ``ref``, or the send failed.
        """
        held = self._held_plan(ref, dtype)
        if held is None:  # a rank above 0: it took part in the gather, rank 0 sends
            return {}
        tensors, plan = held
        # the backend's device, not the tensors': a ZeRO-3 export is on the CPU, NCCL sends from the GPU
        rep = transport(backend, timeout_s=self.sync_timeout_s).send(tensors, plan, addr=addr, port=port,
                                                                     device=sync_device(backend), world_size=world_size)
        return {"checksum": rep.digest, "digest": rep.digest, "bytes": rep.bytes, "seconds": rep.seconds,
                "buckets": rep.buckets}

    @fan_out(FanOut.COLLECTIVE)
    def export_weights(self, ref: PolicyRef, *, dtype: str) -> dict[str, Any]:
        """CUDA IPC handles of ``ref``'s weights in ``dtype`` for a receiver on the same GPU
        (the ``cuda_ipc`` transport's ``prepare``), packed on this rank's GPU
        (``sync_device("nccl")``: a ZeRO-3 export is on the CPU); ``release_export`` frees the
        buffers once it has copied them. Under DeepSpeed every rank
        takes part in the gather and the ranks above 0 return ``{}`` (rank 0 exports).

        Raises:
            WeightSyncError: this worker does not hold ``ref``.
        """
        held = self._held_plan(ref, dtype)
        if held is None:  # a rank above 0: it took part in the gather, rank 0 exports
            return {}
        tensors, plan = held
        return self._ipc.prepare(tensors, plan, device=sync_device("nccl"))

    @fan_out(FanOut.RANK0)
    def release_export(self) -> None:
        """Free the buffers of the last ``export_weights`` (the ``cuda_ipc`` transport's
        ``finalize``; rank 0 exported them)."""
        self._ipc.finalize()

