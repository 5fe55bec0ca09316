"""Which transport moves the weights between two ends: ``choose_transport`` (the table in
docs/architecture.md, "Weight sync"; called by ``rft_core.weightsync.session.pull`` alone) and
``transport`` (the registered backend of that name). Importing this module registers every
backend."""
from __future__ import annotations

import torch

from rft_core.weightsync.base import TRANSPORTS, Transport
from rft_core.weightsync.collective import NCCL, Gloo
from rft_core.weightsync.cuda_ipc import CudaIpc
from rft_core.weightsync.engine import SGLangTransport, VLLMTransport
from rft_core.weightsync.local import LocalCopy
from rft_core.weightsync.shm import Shm, host_id

# every backend, in the order of docs/architecture.md's table (their modules register them: base.register)
BACKENDS: tuple[type[Transport], ...] = (VLLMTransport, SGLangTransport, LocalCopy, CudaIpc, Shm, NCCL, Gloo)


def transport(name: str, *, timeout_s: float = 300.0) -> Transport:
    """The transport registered as ``name``, with ``timeout_s``.

    Raises:
        ValueError: no transport has that name.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync transport {name!r}; valid: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](timeout_s=timeout_s)


def device_id(device: torch.device) -> str:
    """The physical device: "cpu", or the GPU's UUID (two processes on one GPU share it)."""
    if device.type != "cuda":
        return device.type
    return str(torch.cuda.get_device_properties(device).uuid)


def group_backend(device: torch.device) -> str:
    """The collective backend a sender whose weights are on ``device`` sends over: ``nccl``
    from a GPU, ``gloo`` from the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def choose_transport(*, backend: str, sender_device: str, receiver_device: torch.device | None = None,
                     same_process: bool = False, engine: str | None = None, sender_host: str = "",
                     shm_free: int = 0, nbytes: int = 0) -> str:
    """The name of the transport between two ends (the table in docs/architecture.md).

    Args:
        backend: the sender's collective backend (``group_backend`` of its device).
        sender_device: the sender's ``device_id``.
        receiver_device: where the receiving model's tensors are (None: an engine).
        same_process: both ends in this process (tests, the no-Ray driver).
        engine: the receiving GPU engine's kind (``"vllm"``, ``"sglang"``), None for an HF copy.
        sender_host: the sender's ``shm.host_id``.
        shm_free: bytes the sender's ``/dev/shm`` has for a segment (``Shm.capacity``).
        nbytes: bytes of the segment (``shm.segment_layout`` of the plan).
    Returns:
        ``engine`` for an engine (its loader, over ``backend``); ``"local"`` in one process;
        ``"cuda_ipc"`` for two processes on one GPU (NCCL refuses two ranks on one GPU);
        ``"shm"`` for two processes on the CPU of one host whose ``/dev/shm`` has room; else
        ``backend`` (``"gloo"`` or ``"nccl"``).
    """
    if engine is not None:
        return engine
    if same_process:
        return "local"
    if receiver_device is not None and receiver_device.type == "cuda" and sender_device == device_id(receiver_device):
        return "cuda_ipc"
    if (backend == "gloo" and receiver_device is not None and receiver_device.type == "cpu"
            and sender_host == host_id() and 0 < nbytes <= shm_free):
        return "shm"
    return backend
