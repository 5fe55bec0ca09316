"""A resident model worker: one long-lived process per model role that keeps its model (and the
trainer's optimizer) across iterations and runs the ordinary stage programs with it.

Roles (``ROLE_OF_PROGRAM``):

- ``policy``: the trainer. Runs ``ppo_update``; keeps the policy's model, float32 master
  weights and AdamW state in memory, and sends the new weights to the rollout worker
  (``prepare_weights`` / ``send_weights``).
- ``rollout``: the rollout engine's copy of the policy, in ``policy.dtype``. Runs ``rollout``
  and ``actor_logprobs`` (both need the policy before the update). When a program asks for a
  policy version it does not hold, it pulls the weights from the policy worker
  (``rft_core.weightsync``: bucketed, under a timeout, digest-verified; its weights count as
  invalid until the sync has landed, so it never serves a half-updated model).
- ``reference``: the reference model, loaded once per run. Runs ``ref_logprobs``.
- ``critic``: the critic (value model) with its AdamW state. Runs ``critic_values`` (on the
  trained model it holds) and ``critic_update`` (continuing its strategy in memory). The critic
  still commits its weights and AdamW state every iteration (``checkpoint.every`` concerns the
  policy), so its files equal stage mode's; what it saves is the two loads per iteration.

``ModelWorker.run`` runs a stage program exactly as ``run_stage`` does in a stage process,
inside ``models_from(self)``: the program asks this worker for its model
(``rft_core.stages.sources``) instead of loading it, and commits the same shards under the same
config hash. A worker that starts (or restarts after a crash) holds nothing: its first program
loads the model it needs from storage, and the trainer rebuilds a policy that was never
written (``checkpoint.every`` > 1) from the last checkpoint by re-applying the committed updates
after it (``rft_core.stages.recovery``, ``rft_core.workers.rebuild``).

The class is plain Python (tests drive it in-process); ``rft_core.workers.pool`` runs it as a
Ray actor.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from typing import Any, Mapping

import torch

from rft_core.counters import count, counts
from rft_core.models.hub import torch_dtype
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import default_device
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.inprocess import run_in_process
from rft_core.stages.optimizer_state import wait_for_optimizer_writes
from rft_core.stages.recovery import has_weights, weights_base
from rft_core.stages.sources import critic_model, models_from, version_key
from rft_core.stages.update import configure_trainer
from rft_core.training.strategy import continue_with
from rft_core.weightsync.choose import choose_transport, device_id, group_backend, transport
from rft_core.weightsync.collective import free_port, host_address
from rft_core.weightsync.plan import SyncPlan, WeightSyncError, state_tensors, sync_device
from rft_core.weightsync.trained import strategy_device, trained_tensors
from rft_core.workers.engine_sync import full_checkpoint, pull_into_engine
from rft_core.workers.rebuild import rebuild_trainer
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")

NAMESPACE = "prefect-rft"  # the Ray namespace of the workers


class WorkerError(RuntimeError):
    """A resident worker could not be started or reached (Ray missing, cluster unreachable, a
    peer that is not running)."""


def actor_name(pool: str, role: str, rank: int = 0) -> str:
    """The Ray actor name of ``role`` (its rank ``rank``: the policy trainer's data-parallel
    ranks) in the pool ``pool`` (the run root)."""
    name = f"{role}-{hashlib.sha256(pool.encode()).hexdigest()[:16]}"
    return name if rank == 0 else f"{name}-rank{rank}"


ROLE_OF_PROGRAM = {"ppo_update": "policy", "rollout": "rollout", "actor_logprobs": "rollout", "ref_logprobs": "reference",
                   "critic_values": "critic", "critic_update": "critic"}
ROLES = ("policy", "rollout", "reference", "critic")


class ModelWorker:
    """The body of one resident worker (see the module docstring).

    Args:
        role: one of ``ROLES``.
        pool: the pool's name (the run root); the policy worker of the same pool is looked up
            by name when weights are needed (``peer``).
        threads: torch threads (None: leave torch's setting). The same count as a stage-mode run
            keeps CPU results bit-identical.
        sync_timeout_s, sync_bucket_mb: the weight-sync transaction's limits.
        policy_ranks: the policy trainer's data-parallel ranks (DeepSpeed), one worker each: the
            rollout worker asks every rank (a ZeRO-3 gather and a rebuild are collectives) and
            takes rank 0's answer.
        rollout_versions: policy versions the rollout worker keeps a copy of (``rollout.max_staleness``
            s > 1 samples with version i-s while the actor pass needs i-1: s copies).
        peer: for tests without Ray: the policy worker object itself.
    """

    def __init__(self, role: str, pool: str, *, threads: int | None = None, sync_timeout_s: float = 300.0,
                 sync_bucket_mb: int = 256, policy_ranks: int = 1, rollout_versions: int = 1,
                 peer: "ModelWorker | None" = None) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; valid: {', '.join(ROLES)}")
        if threads:
            torch.set_num_threads(threads)
        self.role, self.pool = role, pool
        self.sync_timeout_s, self.sync_bucket_mb = sync_timeout_s, sync_bucket_mb
        self._peer = peer
        self.policy_ranks = policy_ranks
        self.rollout_versions = rollout_versions
        self._kept: dict[str, torch.nn.Module] = {}  # rollout: the copies of other policy versions
        self._arrived: dict[str, int] = {}  # rollout: version -> the order it arrived in (load or sync)
        self.model: torch.nn.Module | None = None  # rollout / reference: the inference copy
        self.model_dtype: str | None = None
        self.version: str | None = None  # what self.model (rollout, reference) or the trainer (policy) holds
        self.held: Any = None  # policy: the rft_core.stages.update.PolicyTrainer it keeps
        self.critic_held: Any = None  # critic: its training strategy (model and AdamW state)
        self.critic_version: str | None = None
        self._ipc = transport("cuda_ipc", timeout_s=sync_timeout_s)  # policy: what export_weights shares
        self._merged: str | None = None  # rollout: a LoRA checkpoint merged for a GPU engine (engine_policy)
        self._prepared: tuple[str | None, Any] | None = None  # policy: (version, tensors) of a prepared sync
        self.syncs: list[dict[str, Any]] = []

    # -- running programs -------------------------------------------------------------------
    def run(self, inp) -> Any:
        """Run the stage program of ``inp`` (a stage input model) with this worker's models;
        returns what the program returns (its committed ShardRef).

        Raises:
            ValueError: a program this role does not run.
        """
        if ROLE_OF_PROGRAM.get(inp.program) != self.role:
            raise ValueError(f"the {self.role} worker does not run {inp.program!r} (it runs "
                             f"{', '.join(p for p, r in ROLE_OF_PROGRAM.items() if r == self.role)})")
        with models_from(self):
            return run_in_process(inp)

    def stats(self) -> dict[str, Any]:
        """This worker's counters (``rft_core.counters.counts``), its pid, role and the
        version it holds."""
        return {**counts(), "role": self.role, "pid": os.getpid(), "version": self.version}

    def close(self) -> None:
        """Finish this worker's pending background writes (the policy's optimizer state) before it is stopped.

        Raises:
            OptimizerStateError: a write failed (resuming the run recomputes that state).
        """
        wait_for_optimizer_writes()

    def ping(self) -> int:
        """The worker's pid (a liveness check: tests/rft_core/training/test_deepspeed_update.py)."""
        return os.getpid()

    def rendezvous(self) -> dict[str, Any]:
        """Where the ranks of a new policy gang meet (this is rank 0): an address of this host and a free port."""
        return {"addr": host_address(), "port": free_port()}

    def set_dist_env(self, env: dict[str, str]) -> None:
        """Set this rank's torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ...) before its first update forms DeepSpeed's process group (``init_distributed``)."""
        os.environ.update(env)

    # -- ModelSource ------------------------------------------------------------------------
    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> torch.nn.Module:
        """The model of ``ref`` for an inference pass (``ModelSource``): the reference worker's
        model (loaded once), or the rollout worker's copy of the policy, synced to ``ref``."""
        key = version_key(ref)
        if role == "reference":
            if self.model is None or self.version != key or self.model_dtype != dtype:
                self.model, self.version, self.model_dtype = self._load(ref, dtype), key, dtype
            return self.model
        if self.model is None or self.model_dtype != dtype:
            base = weights_base(ref)
            self._kept.clear()
            self.model, self.model_dtype, self.version = self._load(base, dtype), dtype, version_key(base)
            self._arrived = {self.version: 0}
            count("engine_builds")
        if self.version != key:
            self._switch(key)
        if self.version != key:
            self._pull(ref)
        return self.model

    def _switch(self, key: str) -> None:
        """With ``rollout_versions`` > 1 (asynchronous RL, ``rollout.max_staleness`` s: the
        rollout samples with version i-s while the actor pass needs i-1): make ``self.model``
        the kept copy holding ``key`` if there is one; otherwise free a copy to sync the new
        version into: a new copy while fewer than ``rollout_versions`` exist, else the copy whose
        version arrived first (versions first arrive in order, for the actor passes, and the
        rollouts ask for the last s of them). A version no copy holds any more is synced again
        (``_pull``)."""
        if self.rollout_versions <= 1 or self.version is None:
            return
        if key in self._kept:
            held, self.model = self.model, self._kept.pop(key)
            self._kept[self.version], self.version = held, key
            return
        copies = [*self._kept, self.version]
        if len(copies) < self.rollout_versions:
            self._kept[self.version], self.model = self.model, copy.deepcopy(self.model)
        else:
            oldest = min(copies, key=lambda k: self._arrived.get(k, -1))
            self._arrived.pop(oldest, None)
            if oldest != self.version:  # else the current copy is the oldest: the new version replaces it
                self._kept[self.version], self.model = self.model, self._kept.pop(oldest)
        self.version = None  # the freed copy holds no version until the sync lands

    def trained(self, ref: PolicyRef) -> None:
        """``ModelSource.trained``: the trainer now holds ``ref`` (weights kept for a sync of the
        version before are dropped)."""
        self.version, self._prepared = version_key(ref), None

    def engine_policy(self, engine, ref: PolicyRef) -> None:
        """``ModelSource.engine_policy``: make the rollout worker's GPU engine (``VLLMEngine``,
        ``SGLangEngine``, built once per run by ``make_engine``) hold ``ref``: an in-memory sync
        from the policy worker into the engine's own loader (``pull_into_engine``: the ``vllm`` or
        ``sglang`` transport of ``rft_core.weightsync``; every rank of the policy gang takes
        part, checksums compared, the engine invalid until it lands), or, when the trainer does
        not hold ``ref`` and it is on storage (the initial model, a resume), its checkpoint
        reloaded in place (``full_checkpoint``: a LoRA adapter merged first). A sync is counted
        and recorded in ``syncs``.

        Raises:
            WeightSyncError: the sync failed or its checksums differ.
            WorkerError: the policy worker is not a Ray actor (an engine sync crosses processes).
        """
        if isinstance(self.peer(), ModelWorker):
            raise WorkerError("a GPU engine receives its weights from the policy worker's process: run the workers as "
                              "Ray actors (rft_core.workers.pool)")
        key = version_key(ref)
        if engine.weights_version == key:
            return
        rep = pull_into_engine(engine, ref, prepare=lambda r, dtype: self._call("prepare_weights", r, dtype=dtype),
                               send_async=lambda r, **kw: self._call_async("send_weights", r, **kw), wait=self._wait,
                               timeout_s=self.sync_timeout_s, bucket_mb=self.sync_bucket_mb)
        if rep["status"] == "storage":
            path, self._merged = full_checkpoint(ref, self._merged)
            engine.load_policy(path)
            return
        self.record_sync(key, rep["bytes"], rep["seconds"], rep["backend"], rep["buckets"], engine=type(engine).__name__)

    # -- the critic worker ---------------------------------------------------------------------
    def critic_model(self, ref: PolicyRef, *, dtype: str) -> torch.nn.Module:
        """``ModelSource.critic_model``: the trained critic this worker holds when it holds
        ``ref`` in ``dtype`` (eval mode), else the critic loaded from storage (not kept: the
        update builds its own strategy)."""
        held = self.critic_held
        if held is not None and self.critic_version == version_key(ref) and \
                next(held.model.parameters()).dtype == torch_dtype(dtype):
            return held.model.eval()
        with models_from(None):  # type: ignore[arg-type]  # storage
            return critic_model(ref, dtype=dtype)

    def critic_strategy(self, ref: PolicyRef, build, *, lr: float, max_grad_norm: float):
        """``ModelSource.critic_strategy``: the kept strategy when it holds ``ref`` (continued
        with ``lr`` and ``max_grad_norm``), else ``build()`` (from storage), kept from now on."""
        if self.critic_held is None or self.critic_version != version_key(ref):
            self.critic_held = None  # the old strategy is freed before the new one is loaded
            self.critic_held, self.critic_version = build(), version_key(ref)
            return self.critic_held
        continue_with(self.critic_held, lr=lr, max_grad_norm=max_grad_norm)
        return self.critic_held

    def critic_trained(self, ref: PolicyRef) -> None:
        """``ModelSource.critic_trained``: the kept strategy now holds ``ref``."""
        self.critic_version = version_key(ref)

    def _load(self, ref: PolicyRef, dtype: str) -> torch.nn.Module:
        return load_causal_lm(policy_model_path(ref), dtype=dtype).to(default_device()).eval()

    # -- the policy worker: trainer and weight source -----------------------------------------
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

    def prepare_weights(self, ref: PolicyRef, dtype: str | None = None) -> dict[str, Any]:
        """Get ready to send ``ref``'s weights: ``{"status": "storage"}`` when this worker does
        not hold ``ref`` and ``ref`` has its weights on storage (the receiver loads them there:
        a resume), else rebuild it if needed and return where to meet (``addr``, ``port``) and
        this worker's device (``device``: same GPU means CUDA IPC instead of a process group).
        With ``dtype`` (a receiver without an HF-named copy of the model of its own: a vLLM or
        SGLang engine) the answer also has ``plan``: the sync plan in that dtype
        (``SyncPlan.to_json``)."""
        if self.role != "policy":
            raise ValueError(f"the {self.role} worker holds no trainer")
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

    def send_weights(self, ref: PolicyRef, *, addr: str, port: int, dtype: str, backend: str,
                     world_size: int = 2) -> dict[str, Any]:
        """Rank 0 of the sync of ``ref`` (held after ``prepare_weights``) to ``world_size - 1``
        receivers in ``dtype``, packed bucket by bucket on the backend's device
        (``sync_device``: this rank's GPU for NCCL, wherever the weights are: DeepSpeed ZeRO-3
        gathers them to the CPU); returns the sender's report (``checksum``, and the same value
        as ``digest``, of the weights as sent). The other ranks of a DeepSpeed gang take part in
        the gather and return ``{}``."""
        if self.version != version_key(ref):
            raise WeightSyncError(f"the policy worker holds {self.version}, not {version_key(ref)}")
        tensors = self._send_tensors()
        if tensors is None:  # a rank above 0: it took part in the gather, rank 0 sends
            return {}
        plan = SyncPlan.of(tensors, dtype=dtype, bucket_mb=self.sync_bucket_mb)
        # the backend's device, not the tensors': a ZeRO-3 export is on the CPU, NCCL sends from the GPU
        rep = transport(backend, timeout_s=self.sync_timeout_s).send(tensors, plan, addr=addr, port=port,
                                                                     device=sync_device(backend), world_size=world_size)
        return {"checksum": rep.digest, "digest": rep.digest, "bytes": rep.bytes, "seconds": rep.seconds,
                "buckets": rep.buckets}

    def export_weights(self, ref: PolicyRef, *, dtype: str) -> dict[str, Any]:
        """CUDA IPC handles of ``ref``'s weights in ``dtype`` for a receiver on the same GPU
        (the ``cuda_ipc`` transport's ``prepare``), packed on this rank's GPU
        (``sync_device("nccl")``: a ZeRO-3 export is on the CPU); ``release_export`` frees the
        buffers once it has copied them. Under DeepSpeed every rank
        takes part in the gather and the ranks above 0 return ``{}`` (rank 0 exports)."""
        if self.version != version_key(ref):
            raise WeightSyncError(f"the policy worker holds {self.version}, not {version_key(ref)}")
        tensors = self._send_tensors()
        if tensors is None:  # a rank above 0: it took part in the gather, rank 0 exports
            return {}
        plan = SyncPlan.of(tensors, dtype=dtype, bucket_mb=self.sync_bucket_mb)
        return self._ipc.prepare(tensors, plan, device=sync_device("nccl"))

    def release_export(self) -> None:
        """Free the buffers of the last ``export_weights`` (the ``cuda_ipc`` transport's ``finalize``)."""
        self._ipc.finalize()

    # -- the rollout worker: pulling weights --------------------------------------------------
    def peer(self):
        """The pool's policy worker (a Ray actor handle, or the object given in tests)."""
        if self._peer is not None:
            return self._peer
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        try:
            return ray.get_actor(actor_name(self.pool, "policy"), namespace=NAMESPACE)
        except ValueError:
            raise WorkerError(f"the policy worker of {self.pool} is not running: the {self.role} worker needs it for "
                              "the weights of a policy that is not on storage") from None

    def peers(self) -> list:
        """Every rank of the pool's policy worker, rank 0 first (one unless ``policy_ranks`` > 1)."""
        first = self.peer()
        if self.policy_ranks == 1 or isinstance(first, ModelWorker):
            return [first]
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        try:
            return [first, *(ray.get_actor(actor_name(self.pool, "policy", rank=r), namespace=NAMESPACE)
                             for r in range(1, self.policy_ranks))]
        except ValueError:
            raise WorkerError(f"a rank of the policy worker of {self.pool} is not running") from None

    def _call_async(self, method: str, *args, **kwargs) -> list:
        """Start ``method`` on every policy rank (Ray object refs, rank 0 first)."""
        return [getattr(p, method).remote(*args, **kwargs) for p in self.peers()]

    def _wait(self, futures: list):
        """Rank 0's result of ``_call_async``'s calls, after all of them (a failed rank raises)."""
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        return ray.get(futures, timeout=self.sync_timeout_s)[0]

    def _call(self, method: str, *args, **kwargs):
        """Call ``method`` of the policy worker (every rank) and wait for rank 0's answer (Ray or in-process)."""
        peer = self.peer()
        if isinstance(peer, ModelWorker):
            return getattr(peer, method)(*args, **kwargs)
        return self._wait(self._call_async(method, *args, **kwargs))

    def _pull(self, ref: PolicyRef) -> None:
        """Make this worker's copy hold ``ref``: from storage when the trainer does not hold it
        and it is stored (a resume), else by a verified weight sync from the policy worker."""
        t0 = time.perf_counter()
        ready = self._call("prepare_weights", ref)
        if ready["status"] == "storage":
            self.model, self.version = self._load(ref, self.model_dtype), version_key(ref)
            self._arrived[self.version] = max(self._arrived.values(), default=-1) + 1
            return
        self.version = None  # invalid until the sync has landed and been verified
        target = state_tensors(self.model)
        plan = SyncPlan.of(target, bucket_mb=self.sync_bucket_mb)
        device = next(iter(target.values())).device
        name = choose_transport(backend=ready["backend"], sender_device=ready["device"], receiver_device=device,
                                same_process=isinstance(self.peer(), ModelWorker))
        got = transport(name, timeout_s=self.sync_timeout_s).receive(
            target, plan, PolicySender(self, ref), what=f"weight sync of {version_key(ref)}", addr=ready["addr"],
            port=ready["port"], dtype=self.model_dtype, who=self.role)
        self.version = version_key(ref)
        self._arrived[self.version] = max(self._arrived.values(), default=-1) + 1
        seconds = time.perf_counter() - t0
        self.record_sync(self.version, got.bytes, seconds, got.backend, got.buckets)
        log.info("weight sync (%s): %.1f MB in %.2f s (%.2f s/GB), digest verified", got.backend, got.bytes / 1e6,
                 seconds, seconds / max(got.bytes / 1e9, 1e-12))

    def record_sync(self, version: str, nbytes: int, seconds: float, backend: str, buckets: int, **extra) -> None:
        """Count a landed sync (``weight_syncs``, ``weight_sync_seconds``, ``weight_sync_bytes``)
        and keep its record in ``syncs``."""
        count("weight_syncs")
        count("weight_sync_seconds", seconds)
        count("weight_sync_bytes", nbytes)
        self.syncs.append({"version": version, "bytes": nbytes, "seconds": seconds, "backend": backend,
                           "buckets": buckets, **extra})

    # -- ModelSource.trainer -----------------------------------------------------------------
    def trainer(self, inp):  # type: ignore[no-redef]
        """``ModelSource.trainer``: the trainer holding ``inp.policy``, with this update's
        learning rate and clipping."""
        trainer = self._ensure_trainer(inp.policy, inp)
        configure_trainer(trainer, inp.update)
        return trainer


class PolicySender:
    """The rollout worker's handle on the policy worker's side of one sync of ``ref``
    (``rft_core.weightsync.base.Sender``): the calls a transport makes, fanned out to every rank
    of the policy gang (Ray) or made on the in-process policy worker (tests, the no-Ray driver)."""

    def __init__(self, worker: ModelWorker, ref: PolicyRef) -> None:
        self.worker, self.ref = worker, ref

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The in-process policy worker's weights (the ``local`` transport)."""
        return self.worker.peer()._send_tensors()

    def start(self, **meet: Any) -> list:
        """Start ``send_weights`` of ``ref`` on every policy rank (Ray object refs)."""
        return self.worker._call_async("send_weights", self.ref, **meet)

    def wait(self, started: list) -> dict[str, Any]:
        """Rank 0's report of ``start``'s sends, after all of them (a failed rank raises)."""
        return self.worker._wait(started)

    def cancel(self, started: list) -> None:
        """Cancel ``start``'s sends (the receiver failed)."""
        import ray  # lazy: Ray is only needed when the workers are Ray actors

        for fut in started:
            ray.cancel(fut, force=False)

    def export(self) -> dict[str, Any]:
        """The policy worker's ``export_weights`` of ``ref`` in the receiver's dtype (CUDA IPC)."""
        return self.worker._call("export_weights", self.ref, dtype=self.worker.model_dtype)

    def release(self) -> None:
        """The policy worker's ``release_export``."""
        self.worker._call("release_export")
