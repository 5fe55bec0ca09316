"""The engine transports (``vllm``, ``sglang``): a weight sync into a GPU engine's own loader.

The engine (``VLLMEngine``, ``SGLangEngine``; this package does not import them) is the receiver:
``engine.receive_weights(plan, *, addr, port, backend, timeout_s, version) -> dict`` joins the
collective transaction (``rft_core.weightsync.collective.receive_buckets``: every vLLM
tensor-parallel worker as one rank; SGLang in the engine's process, rank 1 of 2) and hands each
bucket's tensors to the engine's loader, which maps HF names to its fused, sharded parameters.
The engine also provides ``sync_world_size``, ``sync_dtype``, ``invalidate_weights()`` and
``weights_version``; it refuses a plan that does not fit its model at the transaction's plan
check (``SyncedWeights.plan_refusal``), so the sender fails at once too and nothing lands. Until
the checksums agree the engine's weights count as invalid: an engine that failed a sync serves
nothing until a sync or a checkpoint load succeeds.
"""
from __future__ import annotations

from typing import Any

from rft_core.weightsync.base import Sender, Transport, register, settle
from rft_core.weightsync.plan import SyncPlan, WeightSyncError


def check_buckets(plan: SyncPlan, bucket_mb: float) -> None:
    """Raise ``WeightSyncError`` when a bucket of several tensors exceeds ``bucket_mb`` MiB (the
    receiving device holds one bucket at a time; one tensor larger than that is its own bucket)."""
    limit = int(bucket_mb * 2**20)
    for i, size in enumerate(plan.bucket_sizes):
        if size > limit and len(plan.bucket(i)) > 1:
            raise WeightSyncError(f"the sender's sync plan has a bucket of {size / 2**20:.1f} MiB holding several "
                                  f"tensors, over this worker's {bucket_mb:g} MiB (sync_bucket_mb differs)")


class EngineTransport(Transport):
    """Into a GPU engine over the sender's collective backend (see the module docstring)."""

    device = "the engine's GPU(s); the sender's backend (gloo or NCCL)"

    def receive(self, into: Any, plan: SyncPlan, sender: Sender, *, what: str, addr: str, port: int, backend: str,
                dtype: str, world_size: int, version: str) -> dict[str, Any]:
        """Start the sender's ``send``, let the engine ``into`` receive (``receive_weights``,
        recording ``version`` as what its weights hold), then compare the checksums.

        Returns:
            the engine's report (``bytes``, ``buckets``, ``checksum``).
        Raises:
            WeightSyncError: the engine's receive failed (after the sender was awaited or ended:
                ``settle``), the sender failed, or the checksums differ; the engine is then
                invalid (``invalidate_weights``).
        """
        started = sender.start(addr=addr, port=port, dtype=dtype, backend=backend, world_size=world_size)
        try:
            got = into.receive_weights(plan, addr=addr, port=port, backend=backend, timeout_s=self.timeout_s,
                                       version=version)
        except WeightSyncError as exc:
            raise WeightSyncError(f"{exc}; {settle(sender, started)}") from exc
        try:
            sent = sender.wait(started)
        except Exception as exc:  # noqa: BLE001  the sender failed after the engine finished
            into.invalidate_weights()
            raise WeightSyncError(f"{what}: the policy worker failed: {exc}") from exc
        if sent.get("checksum") != got["checksum"]:
            into.invalidate_weights()
            raise WeightSyncError(f"{what}: the engine received checksum {got['checksum']}, "
                                  f"the policy worker sent {sent.get('checksum')}")
        return got


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
