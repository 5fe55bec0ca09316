"""A resident rollout worker's GPU engine (vLLM, SGLang) gets the trainer's weights in memory:
the worker's side of the ``vllm`` / ``sglang`` transports (``rft_core.weightsync.engine``).

``pull_into_engine`` asks the policy worker for the plan in the engine's dtype, chooses the
engine's transport (``choose_transport``) and lets it move and verify the weights; the engine
counts as invalid until they land (an engine that failed a sync serves nothing: its ``generate``
raises ``WeightSyncError``, until a sync or a checkpoint load succeeds). The rollout worker's
``ModelSource.engine_policy`` does that sync, or, when the trainer does not hold the version, a
reload from storage (``full_checkpoint``).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from typing import Any, Callable

from rft_core.models.lora import is_adapter_dir, merge_adapter
from rft_core.stages.checkpoints import policy_model_path
from rft_core.stages.sources import version_key
from rft_core.weightsync.choose import choose_transport, transport
from rft_core.weightsync.engine import check_buckets
from rft_core.weightsync.plan import SyncPlan, WeightSyncError
from schemas import PolicyRef

log = logging.getLogger("rft_core.workers")


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
        engine, plan, _CallSender(ref, send_async, wait), what=f"weight sync of {key} into the engine",
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
    ``merged``, with the previous ``merged`` folder removed."""
    path = policy_model_path(ref)
    if not is_adapter_dir(path):
        return path, merged
    old, merged = merged, tempfile.mkdtemp(prefix="rft-merged-policy-")
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return merge_adapter(path, merged), merged


class _CallSender:
    """``pull_into_engine``'s callables as the transport's ``Sender`` (``rft_core.weightsync.base``)."""

    def __init__(self, ref: PolicyRef, send_async: Callable[..., Any], wait: Callable[[Any], dict]) -> None:
        self.ref, self._send_async, self._wait = ref, send_async, wait

    def start(self, **meet: Any) -> Any:
        """``send_async(ref, **meet)``: the policy worker's ``send_weights`` started."""
        return self._send_async(self.ref, **meet)

    def wait(self, started: Any) -> dict:
        """The sender's report (``wait``)."""
        return self._wait(started)
