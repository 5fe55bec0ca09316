"""The in-process transport (``local``): both ends in one process (tests, the no-Ray driver), the
same plan, buckets and checksums as the collective transport, the bytes copied in memory."""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from rft_core.weightsync.base import Sender, Transport, register, verify_digest
from rft_core.weightsync.checksum import Checksum, checksum_method, sync_checksum
from rft_core.weightsync.plan import SyncPlan, SyncReport, bucket_views, check_fits, pack_bucket, unpack_bucket


def copy_weights(tensors: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], plan: SyncPlan,
                 device: torch.device | str | None = None) -> tuple[SyncReport, SyncReport]:
    """A sync between two models of one process (both workers in one process: tests, the
    no-Ray benchmark driver): the same plan, buckets and checksums as ``send_weights`` /
    ``receive_weights``, the bytes copied in memory. Returns (sender report, receiver report).

    Raises:
        WeightSyncError: either side does not fit the plan.
    """
    check_fits(plan, tensors)
    check_fits(plan, target)
    device = torch.device(device) if device is not None else next(iter(target.values())).device
    t0 = time.perf_counter()
    method = checksum_method("local" if device.type == "cpu" else "cuda_ipc")  # host sha256 on CPU, else on the GPU
    check = Checksum(plan.layout(), method)
    for i in range(len(plan.bucket_sizes)):
        buf = pack_bucket(plan, tensors, i, device)
        for name, t in bucket_views(plan, buf, i):
            check.add(name, t)
        unpack_bucket(plan, buf, i, target)
    seconds = time.perf_counter() - t0
    n = len(plan.bucket_sizes)
    return (SyncReport(plan.payload_bytes, seconds, n, check.hexdigest(), "local"),
            SyncReport(plan.payload_bytes, seconds, n, sync_checksum(target, method), "local"))


@register
class LocalCopy(Transport):
    """Both ends in one process: ``copy_weights`` from the sender's tensors into the receiver's."""

    name = "local"
    device = "the receiver's tensors' device"
    upstream = "torch (Tensor.copy_)"

    def receive(self, into: Mapping[str, torch.Tensor], plan: SyncPlan, sender: Sender, *, what: str,
                **meet: Any) -> SyncReport:
        """Copy ``sender.tensors()`` into ``into`` through the plan's buckets; check the checksums.

        Raises:
            WeightSyncError: either side does not fit the plan, or the checksums differ.
        """
        sent, got = copy_weights(sender.tensors(), into, plan)
        verify_digest(got.digest, sent.digest, what)
        return got
