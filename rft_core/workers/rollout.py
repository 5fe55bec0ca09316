"""The rollout engine's resident worker (``RolloutWorker``): the receiving side of every weight
sync. It runs ``rollout`` and ``actor_logprobs`` (both need the policy before the update) on its
copy of the policy in ``policy.dtype``; when a program asks for a policy version it does not
hold, it pulls the weights from the policy trainer's gang (``rft_core.weightsync``: bucketed,
under a timeout, digest-verified; its weights count as invalid until the sync has landed, so it
never serves a half-updated model).

A GPU engine (vLLM, SGLang) gets the trainer's weights in memory the same way, through the
engine's own loader: ``pull_into_engine`` asks the policy gang for the plan in the engine's
dtype, chooses the engine's transport (``choose_transport``) and lets it move and verify the
weights; the engine counts as invalid until they land (an engine that failed a sync serves
nothing: its ``generate`` raises ``WeightSyncError``, until a sync or a checkpoint load
succeeds). When the trainer does not hold the version, the engine reloads it from storage
(``full_checkpoint``).
"""
from __future__ import annotations

import copy
import logging
import shutil
import tempfile
import time
from typing import Any, Callable, ClassVar, Mapping

import torch

from rft_core.config import WorkersConfig
from rft_core.counters import count
from rft_core.models.lora import is_adapter_dir, merge_adapter
from rft_core.models.pretrained import resolve_model_path
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.lineage import has_weights, weights_base
from rft_core.stages.sources import load_from_storage, version_key
from rft_core.weightsync.choose import choose_transport, transport
from rft_core.weightsync.engine import check_buckets
from rft_core.weightsync.plan import SyncPlan, WeightSyncError, state_tensors
from rft_core.workers.base import Gang, ResidentWorker, Started, WorkerError
from rft_core.workers.policy import PolicyWorker
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")


class RolloutWorker(ResidentWorker):
    """The rollout engine's worker (see the module docstring).

    ``version``: the policy version (``version_key``) its copy ``model`` holds; None while a
    sync is landing or after one failed (then the next request syncs again).

    Args:
        pool, rank, ranks, threads, keep_device_cache: ``ResidentWorker``'s.
        sync_timeout_s, sync_bucket_mb: the weight-sync transaction's limits.
        policy_ranks: the size of the policy trainer's gang (DeepSpeed ranks): every rank takes
            part in a sync (a ZeRO-3 gather and a rebuild are collectives), rank 0 sends.
        rollout_versions: policy versions kept (``rollout.max_staleness`` s > 1 samples with
            version i-s while the actor pass needs i-1: s copies).
        peer: for tests without Ray: the policy worker object itself (else its Ray actors, by name).
    """

    role: ClassVar[str] = "rollout"
    programs: ClassVar[tuple[str, ...]] = ("rollout", "actor_logprobs")

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True,
                 sync_timeout_s: float = 300.0, sync_bucket_mb: int = 256, policy_ranks: int = 1,
                 rollout_versions: int = 1, peer: PolicyWorker | None = None) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache)
        self.sync_timeout_s, self.sync_bucket_mb = sync_timeout_s, sync_bucket_mb
        self.policy_ranks, self.rollout_versions = policy_ranks, rollout_versions
        self._peer = peer
        self.model: torch.nn.Module | None = None  # the inference copy of the policy
        self.model_dtype: str | None = None
        self._kept: dict[str, torch.nn.Module] = {}  # the copies of other policy versions
        self._arrived: dict[str, int] = {}  # version -> the order it arrived in (load or sync)
        self._merged: str | None = None  # a LoRA checkpoint merged for a GPU engine (engine_policy)
        self.syncs: list[dict[str, Any]] = []

    @classmethod
    def kwargs_from(cls, workers: WorkersConfig) -> dict[str, Any]:
        """``ResidentWorker.kwargs_from``, the sync's limits, the policy gang's size and the versions kept."""
        return {**super().kwargs_from(workers), "sync_timeout_s": workers.sync_timeout_s,
                "sync_bucket_mb": workers.sync_bucket_mb, "policy_ranks": workers.policy_ranks,
                "rollout_versions": workers.rollout_versions}

    def policy(self) -> Gang:
        """The pool's policy trainer: its gang of Ray actors (every rank, rank 0 first), or the
        object given in tests; waits for its answers at most ``sync_timeout_s``.

        Raises:
            WorkerError: a rank of it is not running.
        """
        if self._peer is not None:
            return Gang(PolicyWorker, [self._peer], timeout_s=self.sync_timeout_s)
        return Gang.named(PolicyWorker, self.pool, self.policy_ranks, timeout_s=self.sync_timeout_s)

    # -- ModelSource ------------------------------------------------------------------------
    def inference_model(self, ref: PolicyRef, *, dtype: str, role: str) -> torch.nn.Module:
        """``ModelSource.inference_model``: this worker's copy of the policy, synced to ``ref``
        (its base checkpoint loaded on first use).

        Raises:
            ValueError: ``role`` is not "policy".
            WeightSyncError: the sync failed (this worker then holds no version).
        """
        if role != "policy":
            raise ValueError(f"the rollout worker holds the policy, not the {role}")
        key = version_key(ref)
        if self.model is None or self.model_dtype != dtype:
            base = weights_base(ref)
            self._kept.clear()
            self.model, self.model_dtype, self.version = load_from_storage(base, dtype=dtype), dtype, version_key(base)
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

    def _landed(self) -> None:
        """Record that ``self.version`` arrived after every version before it (``_switch`` frees
        the copy whose version arrived first)."""
        self._arrived[self.version] = max(self._arrived.values(), default=-1) + 1

    def _pull(self, ref: PolicyRef) -> None:
        """Make this worker's copy hold ``ref``: from storage when the trainer does not hold it
        and it is stored (a resume), else by a verified weight sync from the policy gang."""
        t0 = time.perf_counter()
        policy = self.policy()
        ready = policy.call("prepare_weights", ref)
        if ready["status"] == "storage":
            self.model, self.version = load_from_storage(ref, dtype=self.model_dtype), version_key(ref)
            self._landed()
            return
        self.version = None  # invalid until the sync has landed and been verified
        target = state_tensors(self.model)
        plan = SyncPlan.of(target, bucket_mb=self.sync_bucket_mb)
        device = next(iter(target.values())).device
        name = choose_transport(backend=ready["backend"], sender_device=ready["device"], receiver_device=device,
                                same_process=policy.local)
        got = transport(name, timeout_s=self.sync_timeout_s).receive(
            target, plan, PolicySender(policy, ref, self.model_dtype), what=f"weight sync of {version_key(ref)}",
            addr=ready["addr"], port=ready["port"], dtype=self.model_dtype, who=self.role)
        self.version = version_key(ref)
        self._landed()
        seconds = time.perf_counter() - t0
        self.record_sync(self.version, got.bytes, seconds, got.backend, got.buckets)
        log.info("weight sync (%s): %.1f MB in %.2f s (%.2f s/GB), digest verified", got.backend, got.bytes / 1e6,
                 seconds, seconds / max(got.bytes / 1e9, 1e-12))

    def engine_policy(self, engine, ref: PolicyRef) -> None:
        """``ModelSource.engine_policy``: make this worker's GPU engine (``VLLMEngine``,
        ``SGLangEngine``, built once per run by ``make_engine``) hold ``ref``: an in-memory sync
        from the policy gang into the engine's own loader (``pull_into_engine``: the ``vllm`` or
        ``sglang`` transport of ``rft_core.weightsync``; every rank of the policy gang takes
        part, checksums compared, the engine invalid until it lands), or, when the trainer does
        not hold ``ref`` and it is on storage (the initial model, a resume), its checkpoint
        reloaded in place (``full_checkpoint``: a LoRA adapter merged first). No policy gang runs
        yet before the first update (iteration 1's rollout, or a resumed run's first rollout): a
        ``ref`` on storage is then its checkpoint, which a fresh engine built from it already
        holds (nothing reloads). A sync is counted and recorded in ``syncs``.

        Raises:
            WeightSyncError: the sync failed or its checksums differ.
            WorkerError: the policy worker is not a Ray actor (an engine sync crosses processes),
                or it is not running and ``ref`` is not on storage (an update that kept its
                weights in memory).
        """
        key = version_key(ref)
        if engine.weights_version == key:  # already holds it: no policy lookup on this path
            return
        policy = self._running_policy(ref)
        if policy is None:
            rep = {"status": "storage"}
        elif policy.local:
            raise WorkerError("a GPU engine receives its weights from the policy worker's process: run the workers as "
                              "Ray actors (rft_core.workers.pool)")
        else:
            rep = pull_into_engine(engine, ref, prepare=lambda r, dtype: policy.call("prepare_weights", r, dtype=dtype),
                                   send_async=lambda r, **kw: policy.start("send_weights", r, **kw), wait=policy.wait,
                                   cancel=lambda started: policy.kill(), timeout_s=self.sync_timeout_s,
                                   bucket_mb=self.sync_bucket_mb)
        if rep["status"] == "storage":
            path, self._merged = full_checkpoint(ref, self._merged)
            engine.load_policy(path)
            return
        self.record_sync(key, rep["bytes"], rep["seconds"], rep["backend"], rep["buckets"], engine=type(engine).__name__)

    def _running_policy(self, ref: PolicyRef) -> Gang | None:
        """The policy gang (``policy``), or None when it is not running and ``ref`` is on storage.

        Raises:
            WorkerError: it is not running and ``ref`` has no weights on storage.
        """
        try:
            return self.policy()
        except WorkerError:
            if isinstance(ref, str) or has_weights(ref):
                return None
            raise

    def record_sync(self, version: str, nbytes: int, seconds: float, backend: str, buckets: int, **extra) -> None:
        """Count a landed sync (``weight_syncs``, ``weight_sync_seconds``, ``weight_sync_bytes``)
        and keep its record in ``syncs``."""
        count("weight_syncs")
        count("weight_sync_seconds", seconds)
        count("weight_sync_bytes", nbytes)
        self.syncs.append({"version": version, "bytes": nbytes, "seconds": seconds, "backend": backend,
                           "buckets": buckets, **extra})


class PolicySender:
    """The rollout worker's handle on the policy gang's side of one sync of ``ref``
    (``rft_core.weightsync.base.Sender``): the calls a transport makes, each fanned out as the
    policy worker's method declares (``Gang``).

    Args:
        policy: the policy trainer's gang (Ray actors, or the in-process worker).
        ref: the version synced.
        dtype: the receiver's dtype (what a CUDA IPC export packs in).
    """

    def __init__(self, policy: Gang, ref: PolicyRef, dtype: str | None) -> None:
        self.policy, self.ref, self.dtype = policy, ref, dtype

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The in-process policy worker's weights of ``ref`` (the ``local`` transport)."""
        return self.policy.call("tensors", self.ref)

    def start(self, **meet: Any) -> Started:
        """Start ``send_weights`` of ``ref`` on the policy gang."""
        return self.policy.start("send_weights", self.ref, **meet)

    def wait(self, started: Started) -> dict[str, Any]:
        """Rank 0's report of ``start``'s sends (a failed rank raises)."""
        return self.policy.wait(started)

    def cancel(self, started: Started) -> None:
        """End a send stuck past its limit (``rft_core.weightsync.base.settle``): the policy gang's
        ranks are ended (``Gang.kill``); its next update starts a new gang, rebuilt exactly."""
        self.policy.kill()

    def export(self) -> dict[str, Any]:
        """The policy gang's ``export_weights`` of ``ref`` in the receiver's dtype (CUDA IPC)."""
        return self.policy.call("export_weights", self.ref, dtype=self.dtype)

    def release(self) -> None:
        """The policy gang's ``release_export``."""
        self.policy.call("release_export")


# -- into a GPU engine ----------------------------------------------------------------------------


def pull_into_engine(engine: Any, ref: PolicyRef, *, prepare: Callable[[PolicyRef, str], dict],
                     send_async: Callable[..., Any], wait: Callable[[Any], dict], timeout_s: float,
                     bucket_mb: float, cancel: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Make ``engine`` (a ``VLLMEngine`` or ``SGLangEngine``) hold the policy ``ref`` by an
    in-memory weight sync from the policy worker.

    Args:
        engine: the rollout engine (see the module docstring for what it provides).
        ref: the policy version to hold.
        prepare: ``prepare(ref, dtype)``, the policy worker's ``prepare_weights`` answer:
            ``{"status": "storage"}`` (the worker does not hold ``ref`` and it is on storage) or
            ``{"status": "ready", "addr", "port", "backend", "plan": SyncPlan.to_json(), ...}``.
        send_async: ``send_async(ref, addr=, port=, dtype=, backend=, world_size=)`` starts the
            policy worker's ``send_weights`` and returns a future.
        wait: ``wait(future)`` -> the sender's report ({"checksum", ...}); raises if it failed,
            ``TimeoutError`` when it did not finish within its limit.
        timeout_s: the limit of each collective of the transaction, and of the engine's receive.
        bucket_mb: this worker's bucket limit: a plan with larger multi-tensor buckets is refused.
        cancel: ``cancel(future)`` ends a send stuck past its limit after the engine's receive
            failed (``rft_core.weightsync.base.settle``; the policy gang's ranks are ended); None:
            nothing to end.
    Returns:
        ``{"status": "storage"}``: nothing was moved; the caller loads ``ref`` from storage
        (``engine.load_policy(...)``) as a stage-mode rollout does. Else ``{"status": "synced",
        "bytes", "seconds", "backend", "buckets", "checksum"}``.
    Raises:
        ValueError: a LoRA engine (``engine.sync_world_size``), checked before anything starts.
        WeightSyncError: the sync failed (timeout, a peer gone, a bucket the engine refused, the
            sender failed) or the sender's and the engine's checksums differ; the engine is
            then invalid (an engine whose processes failed is closed: ``SyncedWeights.died``).
            After a receive failure the sender is awaited first (``settle``).
    """
    world_size, dtype = engine.sync_world_size, engine.sync_dtype
    ready = prepare(ref, dtype)
    if ready["status"] == "storage":
        return {"status": "storage"}
    if ready["status"] != "ready" or "plan" not in ready:
        raise WeightSyncError(f"the policy worker's answer to prepare_weights has no sync plan: {sorted(ready)}")
    plan = SyncPlan.from_json(ready["plan"])
    check_buckets(plan, bucket_mb)
    key, backend = version_key(ref), ready["backend"]
    t0 = time.perf_counter()
    name = choose_transport(backend=backend, sender_device=ready.get("device", ""), engine=engine.sync_transport)
    got = transport(name, timeout_s=timeout_s).receive(
        engine, plan, _CallSender(ref, send_async, wait, cancel), what=f"weight sync of {key} into the engine",
        addr=ready["addr"], port=ready["port"], backend=backend, dtype=dtype, world_size=world_size, version=key)
    seconds = time.perf_counter() - t0
    log.info("weight sync into the %s engine (%s): %.1f MB in %.2f s, checksum verified", type(engine).__name__,
             backend, got["bytes"] / 1e6, seconds)
    return {"status": "synced", "bytes": got["bytes"], "seconds": seconds, "backend": backend,
            "buckets": got["buckets"], "checksum": got["checksum"]}


def full_checkpoint(ref: PolicyRef, merged: str | None) -> tuple[str, str | None]:
    """(folder, merged): a folder of ``ref``'s full weights, for an engine to reload when the
    trainer does not hold ``ref`` and it is on storage (the initial model, a resume): its
    checkpoint, or for a LoRA checkpoint its merge (``rft_core.models.lora.merge_adapter``: the
    engine serves the merged weights), written into a new local temporary folder, returned as
    ``merged``, with the previous ``merged`` folder removed. A model alias or hub id is resolved
    as ``make_engine`` resolves the folder it builds the engine from (``resolve_model_path``), so
    an engine built from ``ref`` finds it holds that folder already."""
    path = policy_model_path(ref)
    if not is_adapter_dir(path):
        return resolve_model_path(path), merged
    old, merged = merged, tempfile.mkdtemp(prefix="rft-merged-policy-")
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return merge_adapter(path, merged), merged


class _CallSender:
    """``pull_into_engine``'s callables as the transport's ``Sender`` (``rft_core.weightsync.base``)."""

    def __init__(self, ref: PolicyRef, send_async: Callable[..., Any], wait: Callable[[Any], dict],
                 cancel: Callable[[Any], None] | None = None) -> None:
        self.ref, self._send_async, self._wait, self._cancel = ref, send_async, wait, cancel

    def start(self, **meet: Any) -> Any:
        """``send_async(ref, **meet)``: the policy worker's ``send_weights`` started."""
        return self._send_async(self.ref, **meet)

    def wait(self, started: Any) -> dict:
        """The sender's report (``wait``)."""
        return self._wait(started)

    def cancel(self, started: Any) -> None:
        """End a send stuck past its limit (``cancel``; nothing without one)."""
        if self._cancel is not None:
            self._cancel(started)
