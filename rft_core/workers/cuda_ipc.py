"""A weight sync between two processes on one GPU (``rft_core.workers.sync``'s plan and buckets):
NCCL refuses two ranks on one GPU, so the sender shares its packed buckets as CUDA IPC handles
and the receiver copies from them, as verl's and OpenRLHF's colocated modes do."""
from __future__ import annotations

import time
from typing import Iterable, Mapping

import torch

from rft_core.workers.sync import SyncPlan, SyncReport, _pack, _unpack, check_fits, sync_checksum


def export_cuda_ipc(tensors: Mapping[str, torch.Tensor], plan: SyncPlan, device: torch.device | str) -> tuple[list, list]:
    """Sender side of a sync between two processes on one GPU: pack ``tensors`` into the plan's
    buckets on ``device`` and return (handles, buffers). ``handles`` (picklable, one per bucket:
    ``torch.multiprocessing.reductions.reduce_tensor``) go to the receiver; the caller keeps
    ``buffers`` alive until the receiver has imported them (``buffers_checksum(plan, buffers)``
    is the checksum of the weights as sent).

    Raises:
        WeightSyncError: the tensors do not fit the plan.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    check_fits(plan, tensors)
    device = torch.device(device)
    buffers = [_pack(plan, tensors, i, device) for i in range(len(plan.bucket_sizes))]
    torch.cuda.synchronize(device)
    return [reduce_tensor(b) for b in buffers], buffers


def import_cuda_ipc(handles: Iterable, target: Mapping[str, torch.Tensor], plan: SyncPlan) -> SyncReport:
    """Receiver side of ``export_cuda_ipc``: open each bucket's handle and copy it into
    ``target``; the report's digest is the ``sync_checksum`` of ``target`` after landing."""
    check_fits(plan, target)
    t0 = time.perf_counter()
    for i, (rebuild, args) in enumerate(handles):
        _unpack(plan, rebuild(*args), i, target)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=sync_checksum(target), backend="cuda_ipc")
