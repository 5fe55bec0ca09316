"""A resident rollout worker's GPU engine (vLLM, SGLang) gets the trainer's weights in memory.

``pull_into_engine`` is the receiving side of one weight sync (``rft_core.workers.sync``) into
an engine: the policy worker prepares the plan in the engine's dtype, starts sending, the engine
receives (every vLLM tensor-parallel worker joins the group; SGLang receives in this process)
and loads the buckets with its own loader, and both sides' checksums (``sync_checksum``) must
agree. Until then the engine's weights count as invalid: an engine that failed a sync serves
nothing (its ``generate`` raises ``WeightSyncError``) until a sync or a checkpoint load succeeds.

The engine's side of the protocol (``VLLMEngine``, ``SGLangEngine``): ``sync_world_size``,
``sync_dtype``, ``receive_weights(plan, *, addr, port, backend, timeout_s, version) -> dict``,
``invalidate_weights()`` and ``weights_version`` (the synced version the GPU weights hold). An
engine refuses a plan that does not fit its model (``SyncedWeights.plan_refusal``) at the
transaction's plan check, so the sender fails at once too and nothing lands.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from rft_core.workers.sync import SyncPlan, WeightSyncError
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")


def _check_buckets(plan: SyncPlan, bucket_mb: float) -> None:
    """Raise ``WeightSyncError`` when a bucket of several tensors exceeds ``bucket_mb`` MiB (the
    receiving device holds one bucket at a time; one tensor larger than that is its own bucket)."""
    limit = int(bucket_mb * 2**20)
    for i, size in enumerate(plan.bucket_sizes):
        if size > limit and len(plan.bucket(i)) > 1:
            raise WeightSyncError(f"the sender's sync plan has a bucket of {size / 2**20:.1f} MiB holding several "
                                  f"tensors, over this worker's {bucket_mb:g} MiB (sync_bucket_mb differs)")


def pull_into_engine(engine: Any, ref: PolicyRef, *, prepare: Callable[[PolicyRef, str], dict],
                     send_async: Callable[..., Any], wait: Callable[[Any], dict], timeout_s: float,
                     bucket_mb: float) -> dict[str, Any]:
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
        wait: ``wait(future)`` -> the sender's report ({"checksum", ...}); raises if it failed.
        timeout_s: the limit of each collective of the transaction.
        bucket_mb: this worker's bucket limit: a plan with larger multi-tensor buckets is refused.
    Returns:
        ``{"status": "storage"}``: nothing was moved; the caller loads ``ref`` from storage
        (``engine.load_policy(...)``) as a stage-mode rollout does. Else ``{"status": "synced",
        "bytes", "seconds", "backend", "buckets", "checksum"}``.
    Raises:
        ValueError: a LoRA engine (``engine.sync_world_size``), checked before anything starts.
        WeightSyncError: the sync failed (timeout, a peer gone, a bucket the engine refused, the
            sender failed) or the sender's and the engine's checksums differ; the engine is
            then invalid. After a receive failure the sender is not waited for: it fails on its
            own within ``timeout_s``.
    """
    from rft_core.workers.memory import version_key

    world_size, dtype = engine.sync_world_size, engine.sync_dtype
    ready = prepare(ref, dtype)
    if ready["status"] == "storage":
        return {"status": "storage"}
    if ready["status"] != "ready" or "plan" not in ready:
        raise WeightSyncError(f"the policy worker's answer to prepare_weights has no sync plan: {sorted(ready)}")
    plan = SyncPlan.from_json(ready["plan"])
    _check_buckets(plan, bucket_mb)
    key, backend = version_key(ref), ready["backend"]
    t0 = time.perf_counter()
    future = send_async(ref, addr=ready["addr"], port=ready["port"], dtype=dtype, backend=backend,
                        world_size=world_size)
    got = engine.receive_weights(plan, addr=ready["addr"], port=ready["port"], backend=backend, timeout_s=timeout_s,
                                 version=key)
    try:
        sent = wait(future)
    except Exception as exc:  # noqa: BLE001  the sender failed after the engine finished
        engine.invalidate_weights()
        raise WeightSyncError(f"weight sync of {key} into the engine: the policy worker failed: {exc}") from exc
    if sent.get("checksum") != got["checksum"]:
        engine.invalidate_weights()
        raise WeightSyncError(f"weight sync of {key} into the engine: the engine received checksum {got['checksum']}, "
                              f"the policy worker sent {sent.get('checksum')}")
    seconds = time.perf_counter() - t0
    log.info("weight sync into the %s engine (%s): %.1f MB in %.2f s, checksum verified", type(engine).__name__,
             backend, got["bytes"] / 1e6, seconds)
    return {"status": "synced", "bytes": got["bytes"], "seconds": seconds, "backend": backend,
            "buckets": got["buckets"], "checksum": got["checksum"]}


def engine_policy(worker, engine: Any, ref: PolicyRef) -> None:
    """Make a resident rollout worker's GPU engine hold ``ref``: an in-memory sync from the
    policy worker into the engine's own loader (``pull_into_engine``: every rank of the policy
    gang takes part, the engine's workers receive, checksums compared; the engine is invalid
    until it lands), or, when the trainer does not hold ``ref`` and it is on storage (the
    initial model, a resume), its checkpoint reloaded in place: a LoRA adapter merged into a
    local folder first (``rft_core.models.lora.merge_adapter``), since the engine serves the
    merged weights. The sync is counted and recorded in ``worker.syncs``.

    Args:
        worker: the rollout ``ModelWorker`` (its policy peer a Ray actor).

    Raises:
        WeightSyncError: the sync failed or its checksums differ.
    """
    from rft_core.workers.memory import version_key

    key = version_key(ref)
    if engine.weights_version == key:
        return
    rep = pull_into_engine(engine, ref, prepare=lambda r, dtype: worker._call("prepare_weights", r, dtype=dtype),
                           send_async=lambda r, **kw: worker._call_async("send_weights", r, **kw), wait=worker._wait,
                           timeout_s=worker.sync_timeout_s, bucket_mb=worker.sync_bucket_mb)
    if rep["status"] == "storage":
        engine.load_policy(_full_checkpoint(worker, ref))
        return
    worker.record_sync(key, rep["bytes"], rep["seconds"], rep["backend"], rep["buckets"], engine=type(engine).__name__)


def _full_checkpoint(worker, ref: PolicyRef) -> str:
    """A folder of ``ref``'s full weights: its checkpoint, or a LoRA checkpoint's merge (written
    once into a local temporary folder kept in ``worker._merged``, the previous one removed)."""
    import shutil
    import tempfile

    from rft_core.models.lora import is_adapter_dir, merge_adapter
    from rft_core.stages.checkpoints import policy_model_path

    path = policy_model_path(ref)
    if not is_adapter_dir(path):
        return path
    old, worker._merged = worker._merged, tempfile.mkdtemp(prefix="rft-merged-policy-")
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return merge_adapter(path, worker._merged)
