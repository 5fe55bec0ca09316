"""The rollout engine's resident worker (``RolloutWorker``): the receiving side of every weight
sync. It runs ``rollout`` and ``actor_logprobs`` (both need the policy before the update) on its
copy of the policy in ``policy.dtype``; when a program asks for a policy version it does not
hold, it pulls the weights from the policy trainer's gang: ``rft_core.weightsync.session.pull``
into its copy's tensors (``IntoTensors``; bucketed, under a timeout, digest-verified; its copy
holds no version until the sync has landed, so it never serves a half-updated model).

A GPU engine (vLLM, SGLang) gets the trainer's weights the same way, into the engine's own
loader (``IntoEngine``); the engine counts as invalid until they land (an engine that failed a
sync serves nothing: its ``generate`` raises ``WeightSyncError``, until a sync or a checkpoint
load succeeds). When the trainer does not hold the version, the copy or the engine loads it
from storage (``full_checkpoint`` for an engine). In a LoRA run the engine is built with LoRA on
the base and serves each version's adapters, as stage mode's engine serves an adapter checkpoint:
a sync lands the trainer's adapters in tensors of this worker, which become an adapter folder the engine
loads (``_engine_adapters``). What is this worker's own: which copy holds which version
(``_switch``), and which engine serves.

A synchronous run hands this worker the new policy right after each update (``sync_ahead``, which
the flow calls through ``rft_core.workers.pool.sync_rollout_ahead``): the same pull into its copy
runs on a thread of its own while the driver commits the iteration and starts the next one, so the
next rollout finds the version held. Every call that uses the copy or reports on it (``run``,
``stats``, ``close``) waits for that thread first (``settle``); a sync ahead that failed leaves the
copy holding no version, and the rollout syncs again itself (issue 44).
"""
from __future__ import annotations

import atexit
import copy
import logging
import shutil
import tempfile
import threading
import time
from typing import Any, ClassVar

import torch

from rft_core.config import LoraConfig, WorkersConfig
from rft_core.counters import count
from rft_core.engines import release_engine
from rft_core.models.hub import set_trainable
from rft_core.models.lora import (adapter_base_path, adapter_shell, apply_lora, is_adapter_dir, is_peft_model,
                                  keeps_adapters, merge_adapter, save_adapter)
from rft_core.models.logprobs import default_device
from rft_core.models.pretrained import resolve_model_path
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.lineage import has_weights, weights_base
from rft_core.stages.sources import load_from_storage, version_key
from rft_core.weightsync.landing import IntoEngine, IntoTensors
from rft_core.weightsync.plan import SyncReport, WeightSyncError, state_tensors
from rft_core.weightsync.trained import adapter_tensors
from rft_core.weightsync.session import pull
from rft_core.workers.base import FanOut, Gang, ResidentWorker, WorkerError, fan_out
from rft_core.workers.policy import PolicySendLeg, PolicyWorker
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")


class RolloutWorker(ResidentWorker):
    """The rollout engine's worker (see the module docstring).

    ``version``: the policy version (``version_key``) its copy ``model`` holds; None while a
    sync is landing or after one failed (then the next request syncs again).

    Args:
        pool, rank, ranks, threads, keep_device_cache, freeze_heap: ``ResidentWorker``'s.
        sync_timeout_s, sync_bucket_mb: the weight-sync transaction's limits.
        policy_ranks: the size of the policy trainer's gang (DeepSpeed ranks): every rank takes
            part in a sync (a ZeRO-3 gather and a rebuild are collectives), rank 0 sends.
        rollout_versions: policy versions kept (``rollout.max_staleness`` s > 1 samples with
            version i-s while the actor pass needs i-1: s copies).
        lora: the run's ``update.lora`` (``WorkersConfig.lora``): below float32
            (``keeps_adapters``) each copy keeps the policy's float32 adapters on its base, as the
            trainer and stage mode's passes compute, and a sync moves the adapters only
            (``adapter_tensors``, ``Meet.adapters``); None, or in float32: full weights, a LoRA
            policy's merged. A GPU engine of a LoRA run serves the adapters in any dtype
            (``_engine_adapters``).
        peer: for tests without Ray: the policy worker object itself (else its Ray actors, by name).
    """

    role: ClassVar[str] = "rollout"
    programs: ClassVar[tuple[str, ...]] = ("rollout", "actor_logprobs")

    def __init__(self, pool: str, *, rank: int = 0, ranks: int = 1, threads: int | None = None,
                 keep_device_cache: bool = True, freeze_heap: bool = False,
                 sync_timeout_s: float = 300.0, sync_bucket_mb: int = 256, policy_ranks: int = 1,
                 rollout_versions: int = 1, lora: LoraConfig | None = None,
                 peer: PolicyWorker | None = None) -> None:
        super().__init__(pool, rank=rank, ranks=ranks, threads=threads, keep_device_cache=keep_device_cache,
                         freeze_heap=freeze_heap)
        self.sync_timeout_s, self.sync_bucket_mb = sync_timeout_s, sync_bucket_mb
        self.policy_ranks, self.rollout_versions, self.lora = policy_ranks, rollout_versions, lora
        self._peer = peer
        self.model: torch.nn.Module | None = None  # the inference copy of the policy
        self.model_dtype: str | None = None
        self._kept: dict[str, torch.nn.Module] = {}  # the copies of other policy versions
        self._arrived: dict[str, int] = {}  # version -> the order it arrived in (load or sync)
        self._merged: str | None = None  # a LoRA checkpoint merged for a GPU engine (engine_policy)
        self._shell: tuple[str, Any] | None = None  # (base, adapter_shell of it): the adapters' names and shapes
        self._served: str | None = None  # the adapter folder a LoRA engine serves, landed by a sync
        self._adapter_root: str | None = None  # where those folders are written (removed by close())
        self.syncs: list[dict[str, Any]] = []
        self._ahead: threading.Thread | None = None  # a sync ahead still landing (sync_ahead)

    @classmethod
    def kwargs_from(cls, workers: WorkersConfig) -> dict[str, Any]:
        """``ResidentWorker.kwargs_from``, the sync's limits, the policy gang's size, the versions
        kept and the policy's LoRA adapters."""
        return {**super().kwargs_from(workers), "sync_timeout_s": workers.sync_timeout_s,
                "sync_bucket_mb": workers.sync_bucket_mb, "policy_ranks": workers.policy_ranks,
                "rollout_versions": workers.rollout_versions, "lora": workers.lora}

    def policy(self) -> Gang:
        """The pool's policy trainer: its gang of Ray actors (every rank, rank 0 first), or the
        object given in tests; waits for its answers at most ``sync_timeout_s``.

        Raises:
            WorkerError: a rank of it is not running.
        """
        if self._peer is not None:
            return Gang(PolicyWorker, [self._peer], timeout_s=self.sync_timeout_s)
        return Gang.named(PolicyWorker, self.pool, self.policy_ranks, timeout_s=self.sync_timeout_s)

    # -- the sync ahead ---------------------------------------------------------------------
    @fan_out(FanOut.EACH)
    def sync_ahead(self, ref: PolicyRef, dtype: str) -> None:
        """Start making this worker's copy hold ``ref`` in ``dtype`` (``inference_model``: a
        verified pull from the policy gang) on a thread of its own, and return at once: the
        driver's work between an update and the next rollout (committing the iteration, its
        metrics, the next prompts) overlaps the sync. A failure is logged, not raised: the copy
        then holds no version and the next rollout syncs again, raising what it raises."""
        self.settle()
        self._ahead = threading.Thread(target=self._sync_quietly, args=(ref, dtype), name="rft-sync-ahead",
                                       daemon=True)
        self._ahead.start()

    def _sync_quietly(self, ref: PolicyRef, dtype: str) -> None:
        try:
            self.inference_model(ref, dtype=dtype, role="policy")
        except Exception as exc:  # noqa: BLE001  the rollout's own sync raises it, if it fails again
            log.warning("the rollout worker's sync ahead of %s failed (%s: %s); the next rollout syncs again",
                        version_key(ref), type(exc).__name__, exc)

    def settle(self) -> None:
        """Wait for a sync ahead still landing (``sync_ahead``); the seconds waited count as
        ``weight_sync_wait_seconds`` (what of the sync the driver's work did not hide)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            t0 = time.perf_counter()
            ahead.join()
            count("weight_sync_wait_seconds", time.perf_counter() - t0)

    @fan_out(FanOut.COLLECTIVE)
    def run(self, inp) -> Any:
        """``ResidentWorker.run``, once a sync ahead has landed (``settle``)."""
        self.settle()
        return super().run(inp)

    @fan_out(FanOut.EACH)
    def stats(self) -> dict[str, Any]:
        """``ResidentWorker.stats``, once a sync ahead has landed (its counters included)."""
        self.settle()
        return super().stats()

    @fan_out(FanOut.EACH)
    def close(self) -> None:
        """Wait for a sync ahead (``settle``) before the worker is stopped; a worker whose engine
        served adapter folders it wrote (``_engine_adapters``) closes the process's cached engine,
        which serves from them, and removes them (a Ray actor ended by ``ray.kill`` runs no
        ``atexit`` handler)."""
        self.settle()
        root, self._adapter_root, self._served = self._adapter_root, None, None
        if root is not None:
            release_engine()
            shutil.rmtree(root, ignore_errors=True)
        super().close()

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
            self.model, self.model_dtype, self.version = self._read(base, dtype), dtype, version_key(base)
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

    def _adapters(self, dtype: str) -> bool:
        """Whether this worker's copy in ``dtype`` keeps a LoRA policy's adapters (``keeps_adapters``)
        and its syncs move them only; else it is a plain model receiving full (merged) weights."""
        return self.lora is not None and keeps_adapters(dtype)

    def _read(self, ref: PolicyRef, dtype: str) -> torch.nn.Module:
        """``ref``'s model from storage as this worker's copy holds it: a LoRA checkpoint merged,
        or with ``_adapters`` its adapters kept (``load_from_storage``, never the memo's copy)."""
        return load_from_storage(ref, dtype=dtype, merge_adapter=not self._adapters(dtype))

    def _landing(self) -> IntoTensors:
        """Where a sync lands in this worker's copy: its tensors, or with ``_adapters`` its LoRA
        adapters, on a copy that has them: a plain model (the initial policy, before the first
        update) gets the adapters of ``lora`` first (``apply_lora``, drawn under a fixed seed that
        leaves the process's generator as it was; the sync overwrites them)."""
        if not self._adapters(self.model_dtype):
            return IntoTensors(state_tensors(self.model), self.model_dtype, on_invalid=self._forget)
        if not is_peft_model(self.model):
            self.model = set_trainable(apply_lora(self.model, rank=self.lora.rank, alpha=self.lora.alpha,
                                                  dropout=self.lora.dropout, target_modules=self.lora.target_modules,
                                                  base_path="", seed=0), False)
        return IntoTensors(adapter_tensors(self.model), on_invalid=self._forget, adapters=True)

    def _pull(self, ref: PolicyRef) -> None:
        """Make this worker's copy hold ``ref``: a verified weight sync from the policy gang into
        its tensors or, keeping a LoRA policy's adapters, into its adapters (``_landing``; ``pull``:
        the copy holds no version from when bytes may move until the sync is verified), or from
        storage when the trainer does not hold ``ref`` and it is stored (a resume)."""
        key = version_key(ref)
        got = pull(PolicySendLeg(self.policy(), ref), self._landing(), version=key, timeout_s=self.sync_timeout_s,
                   bucket_mb=self.sync_bucket_mb)
        if got is None:
            self.model = self._read(ref, self.model_dtype)
        self.version = key
        self._landed()
        if got is not None:
            self._record(key, got)

    def _forget(self) -> None:
        """The copy holds no version (a sync is landing in it, or failed)."""
        self.version = None

    def _record(self, version: str, got: SyncReport, **extra: Any) -> None:
        """Keep a landed sync's record in ``syncs`` (the session counted it)."""
        self.syncs.append({"version": version, "bytes": got.bytes, "seconds": got.seconds, "backend": got.backend,
                           "buckets": got.buckets, **got.extra, **extra})

    @property
    def engine_lora(self) -> bool:
        """``ModelSource.engine_lora``: a LoRA run (``lora``) has its GPU engine serve the adapters."""
        return self.lora is not None

    def engine_policy(self, engine, ref: PolicyRef) -> None:
        """``ModelSource.engine_policy``: make this worker's GPU engine (``VLLMEngine``,
        ``SGLangEngine``, built once per run by ``make_engine``) hold ``ref``: an in-memory sync
        from the policy gang into the engine's own loader (``pull`` into ``IntoEngine``: the
        ``vllm`` or ``sglang`` transport; every rank of the policy gang takes part, digests
        compared, the engine invalid until it lands), or, when the trainer does not hold ``ref``
        and it is on storage (the initial model, a resume), its checkpoint reloaded in place
        (``full_checkpoint``: a LoRA adapter merged first). No policy gang runs yet before the
        first update (iteration 1's rollout, or a resumed run's first rollout): a ``ref`` on
        storage is then its checkpoint, which a fresh engine built from it already holds (nothing
        reloads). A sync is counted and recorded in ``syncs``. In a LoRA run (``lora``) the
        engine serves adapters instead (``_engine_adapters``).

        Raises:
            ValueError: a LoRA engine outside a LoRA run (a sync moves full weights).
            WeightSyncError: the sync failed or its digests differ.
            WorkerError: the policy worker is not a Ray actor (an engine sync crosses processes),
                or it is not running and ``ref`` is not on storage (an update that kept its
                weights in memory).
        """
        key = version_key(ref)
        if engine.weights_version == key:  # already holds it: no policy lookup on this path
            return
        if self.lora is not None:
            self._engine_adapters(engine, ref, key)
            return
        policy = self._running_policy(ref)
        got = None
        if policy is not None:
            if policy.local:
                raise WorkerError("a GPU engine receives its weights from the policy worker's process: run the workers "
                                  "as Ray actors (rft_core.workers.pool)")
            got = pull(PolicySendLeg(policy, ref), IntoEngine(engine), version=key, timeout_s=self.sync_timeout_s,
                       bucket_mb=self.sync_bucket_mb)
        if got is None:
            path, self._merged = full_checkpoint(ref, self._merged)
            engine.load_policy(path)
            return
        self._record(key, got, engine=type(engine).__name__)

    def _engine_adapters(self, engine, ref: PolicyRef, key: str) -> None:
        """A LoRA run's engine (built with LoRA on the base, ``make_engine``) serves ``ref`` as
        stage mode's engine serves an adapter checkpoint (``LoRARequest``, ``load_lora_adapter``):
        the trainer's float32 adapters are pulled into tensors on this worker's device
        (``default_device``: a GPU's, so that a trainer on a GPU sends over CUDA IPC or NCCL),
        shaped by an adapter shell of the engine's base (``adapter_shell``: the meta device; the
        digest verified), written as a peft adapter folder (``save_adapter``, a new folder under
        this worker's temporary folder; the one served before removed once the engine took the
        new one) and served from it with ``version`` recorded; a version on storage and not held
        by the trainer is served from its checkpoint: the adapter folder itself, or the base alone
        (the initial policy). The engine keeps serving what it served until the new adapter is
        handed to it; its ``weights_version`` is cleared first, so a failed sync leaves it holding
        no version (the next rollout syncs again).

        Raises:
            WeightSyncError: the engine holds no base (it died), or the sync failed.
        """
        base = engine.weights_path
        if base is None:
            raise WeightSyncError(f"the {type(engine).__name__} holds no base model to serve LoRA adapters on "
                                  f"({engine.dead or 'its weights are invalid'}): the next rollout builds a new one")
        policy = self._running_policy(ref)
        got, target = None, None
        if policy is not None:
            target = self._adapter_target(base)
            engine.weights_version = None
            got = pull(PolicySendLeg(policy, ref), IntoTensors(target, adapters=True), version=key,
                       timeout_s=self.sync_timeout_s, bucket_mb=self.sync_bucket_mb)
        if got is None:
            path = policy_model_path(ref)
            if is_adapter_dir(path):
                engine.load_policy(resolve_model_path(adapter_base_path(path)), path)
            else:
                engine.load_policy(resolve_model_path(path))
            return
        if self._adapter_root is None:  # removed by close() (and at the end of the process, as a fallback)
            self._adapter_root = tempfile.mkdtemp(prefix="rft-synced-adapters-")
            atexit.register(shutil.rmtree, self._adapter_root, ignore_errors=True)
        old, folder = self._served, tempfile.mkdtemp(dir=self._adapter_root)
        adapters = {n: t.cpu() for n, t in target.items()}
        del target  # the device's copy: made per sync, not kept beside the engine's memory
        engine.load_policy(base, save_adapter(self._shell[1], adapters, folder), version=key)
        self._served = folder
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._record(key, got, engine=type(engine).__name__)

    def _adapter_target(self, base: str) -> dict[str, torch.Tensor]:
        """The tensors a LoRA engine's adapters land in, on this worker's device
        (``default_device``), new for each sync: one float32 tensor per adapter of ``lora`` on
        ``base`` (``adapter_tensors`` of its ``adapter_shell``, made once per base)."""
        if self._shell is None or self._shell[0] != base:
            self._shell = (base, adapter_shell(base, rank=self.lora.rank, alpha=self.lora.alpha,
                                               dropout=self.lora.dropout, target_modules=self.lora.target_modules))
        device = default_device()
        shapes = adapter_tensors(self._shell[1])  # meta tensors: names, shapes and dtypes only
        return {n: torch.empty(t.shape, dtype=t.dtype, device=device) for n, t in shapes.items()}

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
