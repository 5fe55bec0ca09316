"""The CUDA IPC transport (``cuda_ipc``): a weight sync between two processes on one GPU
(``rft_core.weightsync.plan``'s plan and buckets):
NCCL refuses two ranks on one GPU, so the sender shares its packed buckets as CUDA IPC handles
and the receiver copies from them, as verl's and OpenRLHF's colocated modes do.

The handle names the GPU by its UUID, not by the sender's device index: two processes may number
their GPUs differently (each its own ``CUDA_VISIBLE_DEVICES`` order), and torch's handle carries
the sender's index, which the receiver would open on whatever GPU it numbers so (torch's own
``rebuild_cuda_tensor``; the pending fix is pytorch PR 149248). As SGLang does
(``sglang/srt/utils/patch_torch.py``, 0.5.23: ``_device_to_uuid`` / ``_device_from_maybe_uuid``),
the 7th argument of torch's ``reduce_tensor`` answer (``storage_device``,
``torch/multiprocessing/reductions.py``, torch 2.13) becomes the UUID, and the receiver maps it
back to its own index of that GPU before torch's rebuild opens the handle. SGLang patches
torch's reductions process-wide; here only the sync's own handles are rewritten.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.multiprocessing import reductions

from rft_core.weightsync.base import Meet, Transport, handoff_of, refuse_other_layout, register
from rft_core.weightsync.digest import Digest, sync_method
from rft_core.weightsync.landing import IntoTensors, Landing
from rft_core.weightsync.plan import (SyncPlan, SyncReport, WeightSyncError, bucket_views, check_fits, pack_bucket,
                                      sync_device)

_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` (``torch.cuda.get_device_properties``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device with ``uuid``.

    Raises:
        WeightSyncError: no visible device has that UUID (the receiver does not see the
            sender's GPU: its ``CUDA_VISIBLE_DEVICES`` leaves it out).
    """
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise WeightSyncError(f"CUDA IPC: the sender's GPU {uuid} is not visible to this process (its CUDA devices: "
                          f"{[device_uuid(i) for i in range(torch.cuda.device_count())]}); a same-GPU sync needs "
                          "both processes to see that GPU")


def share_cuda_ipc(buffer: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """The CUDA IPC handle of ``buffer`` (a CUDA tensor): torch's ``reduce_tensor`` answer
    (rebuild function, arguments) with the device index replaced by the device's UUID."""
    rebuild, args = reductions.reduce_tensor(buffer)
    return rebuild, (*args[:_DEVICE_ARG], device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])


def open_cuda_ipc(handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]]) -> torch.Tensor:
    """The tensor of a ``share_cuda_ipc`` handle, opened on this process's index of its GPU.

    Raises:
        WeightSyncError: the GPU is not visible here (``device_index``).
    """
    rebuild, args = handle
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        device = device_index(device)
    return rebuild(*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1:])


def export_cuda_ipc(tensors: Mapping[str, torch.Tensor], plan: SyncPlan, device: torch.device | str) -> tuple[list, list]:
    """Sender side of a sync between two processes on one GPU: pack ``tensors`` (any device:
    each is copied into its bucket) into the plan's buckets on the CUDA ``device`` and return
    (handles, buffers). ``handles`` (picklable, one per bucket: ``share_cuda_ipc``) go to the
    receiver; the caller keeps ``buffers`` alive until the receiver has imported them
    (``buffers_digest(plan, buffers)`` is the digest of the weights as sent).

    Raises:
        WeightSyncError: the tensors do not fit the plan.
        ValueError: ``device`` is not a CUDA device.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA IPC exports from a CUDA device, got {device}")
    check_fits(plan, tensors)
    buffers = [pack_bucket(plan, tensors, i, device) for i in range(len(plan.bucket_sizes))]
    torch.cuda.synchronize(device)
    return [share_cuda_ipc(b) for b in buffers], buffers


def buffers_digest(plan: SyncPlan, buffers: Iterable[torch.Tensor]) -> str:
    """The weight digest (``device`` method, on the buffers' device) of the tensors held in
    ``plan``'s packed buckets ``buffers`` (one flat uint8 tensor per bucket): equal to
    ``weights_digest(tensors, "device")`` of the tensors packed into them."""
    digest = Digest(plan.layout(), sync_method("cuda_ipc"))
    for i, buf in enumerate(buffers):
        for name, t in bucket_views(plan, buf, i):
            digest.add(name, t)
    return digest.hexdigest()


def import_cuda_ipc(handles: Iterable, target: Mapping[str, torch.Tensor] | IntoTensors, plan: SyncPlan) -> SyncReport:
    """Receiver side of ``export_cuda_ipc``: open each bucket's handle on this process's index of
    the sender's GPU (``open_cuda_ipc``) and copy it into ``target`` (tensors, or their
    landing); the report's digest is of ``target`` as landed (``device`` method).

    Raises:
        WeightSyncError: ``target`` does not fit the plan, or the sender's GPU is not visible here.
    """
    landing = target if isinstance(target, IntoTensors) else IntoTensors(target)
    check_fits(plan, landing.target)
    t0 = time.perf_counter()
    digest = Digest(plan.layout(), sync_method("cuda_ipc"))
    for i, handle in enumerate(handles):
        landing.land(plan, i, open_cuda_ipc(handle), digest)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=digest.hexdigest(), backend="cuda_ipc")


@register
class CudaIpc(Transport):
    """Two processes on one GPU, a handoff: the sender's ``send`` packs its buckets on its GPU and
    shares them as CUDA IPC handles (``export_cuda_ipc``), kept until ``finalize``; the receiver
    copies from them."""

    name = "cuda_ipc"
    device = "one GPU shared by both processes"
    upstream = "torch/multiprocessing/reductions.py (reduce_tensor, rebuild_cuda_tensor)"
    handoff = True

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self._buffers: list | None = None

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Pack ``tensors`` on this rank's GPU (``sync_device("nccl")``: a ZeRO-3 export is on the
        CPU) and share them; the report's ``extra["handoff"]`` holds the ``handles``, its digest is
        ``buffers_digest`` of the weights as sent; the buffers are kept until ``finalize``.

        Raises:
            WeightSyncError: the tensors do not fit the plan.
            ValueError: this rank has no CUDA device.
        """
        t0 = time.perf_counter()
        handles, self._buffers = export_cuda_ipc(tensors, plan, sync_device("nccl"))
        return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(handles),
                          digest=buffers_digest(plan, self._buffers), backend=self.name,
                          extra={"handoff": handoff_of(plan, handles=handles)})

    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """Open the handles of ``meet.handoff`` and copy them into the landing (``import_cuda_ipc``).

        Raises:
            TypeError: a landing that is not a model's tensors.
            WeightSyncError: the layouts differ, the landing does not fit the plan, or the
                sender's GPU is not visible here.
        """
        if not isinstance(landing, IntoTensors):
            raise TypeError(f"the cuda_ipc transport lands in a model's tensors, not in {type(landing).__name__}")
        refuse_other_layout(plan, meet.handoff)
        return import_cuda_ipc(meet.handoff["handles"], landing, plan)

    def finalize(self, meet: Meet) -> None:
        """Free the buffers of the last ``send`` (and the CUDA cache)."""
        self._buffers = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
