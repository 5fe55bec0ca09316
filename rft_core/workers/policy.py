"""The policy trainer's resident worker (``PolicyWorker``): runs ``ppo_update``, keeps the
policy's model, float32 master weights and AdamW (or ZeRO) state in memory across iterations,
and is the sender of every weight sync to the rollout engine: it exposes its weights and the
send leg of the transaction (``prepare_weights``, ``send_weights``, ``finish_send``), which the
receiver's session (``rft_core.weightsync.session.pull``) drives through ``PolicySendLeg``. Under
DeepSpeed or FSDP2 it is a gang of ``orchestration.policy_ranks`` ranks, one Ray actor each; its
sync methods are collectives (a ZeRO-3 gather, FSDP2's ``DTensor.full_tensor()`` of every shard,
a rebuild) that every rank runs, rank 0 holding the gathered weights and sending them.

A trainer that was never written (``checkpoint.every`` > 1) and is not in memory (a new or
restarted worker) is rebuilt exactly by ``rft_core.stages.recovery.rebuild_trainer`` (its base
checkpoint loaded with its AdamW state, the committed updates after it re-applied).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from rft_core.config import WorkersConfig
from rft_core.counters import count
from rft_core.heap import collect_all
from rft_core.models.lora import is_peft_model
from rft_core.network import free_port
from rft_core.stages.lineage import has_weights
from rft_core.stages.writer import wait_for_optimizer_writes
from rft_core.stages.recovery import rebuild_trainer
from rft_core.stages.sources import version_key
from rft_core.stages.update import configure_trainer
from rft_core.weightsync.base import Meet, Transport
from rft_core.weightsync.choose import device_id, group_backend, transport
from rft_core.weightsync.collective import host_address
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError
from rft_core.weightsync.session import Offer
from rft_core.weightsync.shm import Shm, host_id
from rft_core.weightsync.trained import merged_tensors, strategy_device, trained_adapters
from rft_core.workers.base import FanOut, Gang, ResidentWorker, Started, fan_out
from schemas import PolicyRef


class PolicyWorker(ResidentWorker):
    """One rank of the policy trainer (see the module docstring).

    ``version``: the policy version (``version_key``) the trainer ``held`` holds: the update it
    last ran or was rebuilt to; None before its first update.

    Args:
        pool, rank, ranks, threads, keep_device_cache, freeze_heap: ``ResidentWorker``'s.
        sync_timeout_s, sync_bucket_mb: the weight-sync transaction's limits.
    """

    role: ClassVar[str] = "policy"
    programs: ClassVar[tuple[str, ...]] = ("ppo_update",)

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True, freeze_heap: bool = False,
                 sync_timeout_s: float = 300.0, sync_bucket_mb: int = 256) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache,
                         freeze_heap=freeze_heap)
        self.sync_timeout_s, self.sync_bucket_mb = sync_timeout_s, sync_bucket_mb
        self.held: Any = None  # the rft_core.stages.update.PolicyTrainer it keeps
        self._links: dict[str, Transport] = {}  # the send legs by transport, kept across syncs (shm: its segment)
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
            if self.held is not None:  # the old trainer is freed before the new one is built
                self.held = None
                collect_all()  # any cycle in it too (a single-process trainer has none: test_heap), if frozen
            trainer, report = rebuild_trainer(ref, inp)
            count("recovered_updates", report["replayed"])
            self.held, self.version = trainer, key
        return self.held

    @fan_out(FanOut.EACH)
    def close(self) -> None:
        """Finish this rank's pending background writes (the optimizer state and, for a resident
        checkpoint iteration, the weights: ``rft_core.stages.optimizer_state``) before the worker
        is stopped, and free what its send legs keep across syncs (``Transport.close``: the
        ``shm`` segment, which a Ray actor ended by ``ray.kill`` would otherwise leave in
        ``/dev/shm`` until the next sender on the host sweeps it).

        Raises:
            OptimizerStateError: a write failed (resuming the run recomputes that state).
        """
        try:
            wait_for_optimizer_writes()
        finally:
            links, self._links = self._links, {}
            for link in links.values():
                link.close()

    # -- the sending side of a weight sync ---------------------------------------------------
    def _link(self, name: str) -> Transport:
        """The transport ``name``'s sending side, kept across syncs (its buffers: ``finish_send``;
        the ``shm`` segment, reused by the next sync)."""
        if name not in self._links:
            self._links[name] = transport(name, timeout_s=self.sync_timeout_s)
        return self._links[name]

    @fan_out(FanOut.COLLECTIVE)
    def prepare_weights(self, ref: PolicyRef, dtype: str | None = None) -> Offer | None:
        """Get ready to send ``ref``'s weights: None when this worker does not hold ``ref`` and
        ``ref`` has its weights on storage (the receiver loads them there: a resume), else
        rebuild it if needed and ``Offer`` it: where to meet, this worker's device (same GPU means
        CUDA IPC instead of a process group), host and room in ``/dev/shm`` (same host on the CPU
        means shared memory). With ``dtype`` (a receiver without an HF-named copy of the model of
        its own: a vLLM or SGLang engine) the offer also has ``plan``: the sync plan in that dtype
        (``SyncPlan.to_json``). Its ``lora`` says whether the policy is a peft LoRA model (the
        receiver's session checks it against its landing: ``check_adapters``)."""
        if (self.held is None or self.version != version_key(ref)) and (
                isinstance(ref, str) or has_weights(ref)):
            return None
        trainer = self._ensure_trainer(ref)
        device = strategy_device(trainer.strategy)
        backend, plan = group_backend(device), None
        if dtype is not None:
            tensors = self._send_tensors(keep=True)  # the send that follows uses them: one gather, one merge
            if tensors is not None:
                plan = SyncPlan.of(tensors, dtype=dtype, bucket_mb=self.sync_bucket_mb).to_json()
        shm = self._link("shm")  # its capacity counts the segment it keeps
        return Offer(backend=backend, device=device_id(device), host=host_id(), addr=host_address(), port=free_port(),
                     shm_free=shm.capacity() if isinstance(shm, Shm) and backend == "gloo" else 0, plan=plan,
                     lora=is_peft_model(getattr(trainer.strategy, "module", trainer.strategy.model)))

    def _send_tensors(self, *, keep: bool = False) -> dict[str, torch.Tensor] | None:
        """The policy's weights as an inference copy holds them (``inference_tensors``); under
        DeepSpeed gathered from the ranks (a collective: every rank calls it), on rank 0 only
        (None on the others). ``keep``: hold them for the next call (a ``prepare_weights`` whose
        plan needs them, then its ``send_weights``), which takes them; a ZeRO-3 gather or a LoRA
        merge then runs once per sync (``merged_tensors``: a sharded LoRA trainer's gathered
        state merged on rank 0)."""
        kept, self._prepared = self._prepared, None
        if kept is not None and kept[0] == self.version:
            tensors = kept[1]
        else:
            tensors = merged_tensors(self.held.strategy)
        if keep:
            self._prepared = (self.version, tensors)
        return tensors

    @fan_out(FanOut.COLLECTIVE)
    def send_weights(self, ref: PolicyRef, meet: Meet) -> SyncReport | None:
        """The send leg of the sync of ``ref`` (held after ``prepare_weights``): rank 0 sends its
        weights in ``meet.dtype`` (``SyncPlan.of`` them, buckets of ``sync_bucket_mb``) over
        ``meet.transport``'s ``send`` and returns its report (the digest of the weights as sent; a
        handoff transport's ``extra["handoff"]``); the other ranks of a DeepSpeed gang take part
        in the gather and return None. With ``meet.adapters`` (a receiver that keeps a LoRA
        policy's adapters on a base of its own) it sends the LoRA adapters only
        (``trained_adapters``: a single-process trainer's, or gathered alone from an FSDP2 gang
        onto rank 0; ``resident_blockers`` refuses LoRA under DeepSpeed).

        Raises:
            WeightSyncError: this worker does not hold ``ref``, the send failed, or adapters were
                asked of a trainer without them.
        """
        if self.version != version_key(ref):
            raise WeightSyncError(f"the policy worker holds {self.version}, not {version_key(ref)}")
        tensors = trained_adapters(self.held.strategy) if meet.adapters else self._send_tensors()
        if tensors is None:  # a rank above 0: it took part in the gather, rank 0 sends
            return None
        plan = SyncPlan.of(tensors, dtype=meet.dtype, bucket_mb=self.sync_bucket_mb)
        return self._link(meet.transport).send(tensors, plan, meet)

    @fan_out(FanOut.RANK0)
    def finish_send(self, meet: Meet) -> None:
        """The transport's ``finalize`` after the receiver took the weights (CUDA IPC: free the
        buffers; rank 0 sent them)."""
        self._link(meet.transport).finalize(meet)


class PolicySendLeg:
    """The policy gang's send leg of one sync of ``ref``, as the receiver's session drives it
    (``rft_core.weightsync.session.SendLeg``): each call fanned out as the policy worker's method
    declares (``Gang``). In one process (tests, the no-Ray driver) a send runs at once (only a
    handoff transport is chosen there: ``local``).

    Args:
        gang: the policy trainer's gang (Ray actors, or the in-process worker).
        ref: the version synced.
    """

    def __init__(self, gang: Gang, ref: PolicyRef) -> None:
        self.gang, self.ref = gang, ref

    @property
    def local(self) -> bool:
        """Whether the gang's ranks are objects of this process."""
        return self.gang.local

    def offer(self, dtype: str | None) -> Offer | None:
        """``PolicyWorker.prepare_weights`` of ``ref``."""
        return self.gang.call(PolicyWorker.prepare_weights, self.ref, dtype)

    def start(self, meet: Meet) -> Started | tuple:
        """``PolicyWorker.send_weights`` started on every rank (in one process: run now, its
        outcome kept for ``wait``)."""
        if not self.gang.local:
            return self.gang.start(PolicyWorker.send_weights, self.ref, meet)
        try:
            return ("done", self.gang.call(PolicyWorker.send_weights, self.ref, meet))
        except Exception as exc:  # noqa: BLE001  raised by wait, as a Ray rank's error is
            return ("failed", exc)

    def wait(self, started: Started | tuple) -> SyncReport:
        """Rank 0's report (a failed rank raises; Ray's ``GetTimeoutError`` past ``sync_timeout_s``)."""
        if isinstance(started, Started):
            return self.gang.wait(started)
        if started[0] == "failed":
            raise started[1]
        return started[1]

    def cancel(self, started: Started | tuple) -> None:
        """End a send stuck past its limit (``rft_core.weightsync.session.settle``): the policy
        gang's ranks are ended (``Gang.kill``); its next update starts a new gang, rebuilt exactly."""
        self.gang.kill()

    def finish(self, meet: Meet) -> None:
        """``PolicyWorker.finish_send``."""
        self.gang.call(PolicyWorker.finish_send, meet)
