"""The bucketed collective transport (``gloo``, ``nccl``): rank 0 (the trainer) broadcasts the
plan's buckets to ranks 1 .. world_size - 1 (a resident worker's copy: one rank; a vLLM engine:
one per tensor-parallel worker; an SGLang engine: one) over a process group of its own.

Each bucket (``rft_core.weightsync.plan``) is one flat ``uint8`` tensor broadcast over a process
group of its own (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` between GPUs) from a
``TCPStore`` rendezvous, destroyed after it: how verl, OpenRLHF and NeMo-RL move weights into
their engines. The first message is the plan's fingerprint, so sides with different models stop
at once. Every collective runs under ``timeout_s``; after the plan check and at the end each
rank reports whether it failed (an all-reduce of one flag per rank), so all ranks stop together
with ``WeightSyncError`` naming the failed ranks. The receiver copies each bucket into its
tensors as it arrives (``receive_weights``) or hands the bucket's tensors to the engine's own
loader (``receive_buckets``: vLLM and SGLang map HF names to their fused, sharded parameters), so
it needs no second copy of the model. Until the sync has landed and been verified the caller
holds the engine's weights as invalid: a failed sync is never served. Only one bucket at a time
is on the device, as OpenRLHF's and verl's ZeRO-3 broadcasts (one ``GatheredParameters`` at a
time) keep it. A CPU device for NCCL is refused before anyone meets.

Failures under NCCL. ``ProcessGroupNCCL``'s ``Work.wait()`` does not block the CPU by default,
and its watchdog thread tears the whole process down when a collective fails or times out
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, torch 2.13). The sync's own NCCL group is therefore
built with ``TORCH_NCCL_BLOCKING_WAIT=1`` (read once by the group's constructor; set only around
it, so no other group of the process changes): torch still starts the group's watchdog thread,
but blocking wait turns its error handling off (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is ignored
for the group), so it takes nothing down; ``wait()`` blocks the CPU and raises
``DistBackendError`` after ``timeout_s``, which becomes ``WeightSyncError``. The one wait not
covered is NCCL's communicator setup at the first collective (``ncclCommInitRank`` blocks while a
peer that met at the rendezvous never arrives). What bounds it is the wait on the participant
from outside (``rft_core.weightsync.base.OWN_WAIT_SHARE``): vLLM's ``collective_rpc`` on its
workers (``VLLMEngine.receive_weights``: the engine is then closed and rebuilt), and the
receiver's wait for the policy gang's send (``rft_core.weightsync.session.settle``: a send stuck
past it is ended with its gang); an SGLang receive runs in the rollout worker's own process, which
nothing outside it bounds but the ping a gang must answer before its next stage
(``rft_core.workers.pool``).

Two processes on one GPU cannot form an NCCL group (NCCL 2.28 refuses: "Duplicate GPU
detected", docs/gpu.md); such a pair moves weights by CUDA IPC handles instead
(``rft_core.weightsync.cuda_ipc``), as verl's and OpenRLHF's colocated modes do.
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from rft_core.weightsync.base import Meet, Transport, register
from rft_core.weightsync.digest import Digest, sync_method
from rft_core.weightsync.landing import IntoTensors, Landing
from rft_core.weightsync.plan import (
    SyncPlan,
    SyncReport,
    WeightSyncError,
    bucket_views,
    check_device,
    check_fits,
    pack_bucket,
    sync_device,
)


def host_address() -> str:
    """An address of this host that the other Ray workers can reach (127.0.0.1 on one machine,
    and in a process that never imported Ray: no Ray there can be initialised, and importing it
    only to ask costs ~1 s, once, inside the first weight sync of an in-process driver)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def _process_group(backend: str, addr: str, port: int, rank: int, timeout_s: float, world_size: int = 2):
    """A process group of ``world_size`` ranks of its own (not the default group), rank 0
    hosting the ``TCPStore`` (``torch.distributed.TCPStore``, ``ProcessGroupGloo``,
    ``ProcessGroupNCCL``: torch/distributed/distributed_c10d.py).

    Raises:
        WeightSyncError: not every rank met at ``addr:port`` within ``timeout_s``.
        ValueError: an unknown backend, or ``rank`` outside 0 .. world_size - 1.
    """
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"weight sync rank {rank} of world size {world_size}: need 0 <= rank < world_size, world_size >= 2")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown weight-sync backend {backend!r}; valid: gloo, nccl")
    timeout = _dt.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, world_size=world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=True)
        if backend == "gloo":  # its construction meets every rank through the store
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    except Exception as exc:  # noqa: BLE001  RuntimeError/DistNetworkError/DistStoreError: a peer never came
        raise WeightSyncError(f"weight sync rendezvous at {addr}:{port} (rank {rank} of {world_size}) failed within "
                              f"{timeout_s:g} s: {exc}") from exc
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with _ENV_LOCK:  # the constructor reads the variable once: this group blocks, no other one changes
        before = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            if before is None:
                del os.environ["TORCH_NCCL_BLOCKING_WAIT"]
            else:
                os.environ["TORCH_NCCL_BLOCKING_WAIT"] = before


_ENV_LOCK = threading.Lock()


def _broadcast(pg, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _dt.timedelta(seconds=timeout_s)
    try:
        pg.broadcast([tensor], opts).wait()
    except Exception as exc:  # noqa: BLE001  gloo/NCCL timeouts and closed connections
        raise WeightSyncError(f"weight sync failed during {what}: {type(exc).__name__}: {exc}") from exc


def _failed_ranks(pg, rank: int, world_size: int, failed: bool, device: torch.device, what: str,
                  timeout_s: float) -> list[int]:
    """Every rank says whether it failed (an all-reduce of one flag per rank): the ranks that did."""
    flags = torch.zeros(world_size, dtype=torch.int64, device=device)
    flags[rank] = int(failed)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.timeout = _dt.timedelta(seconds=timeout_s)
    try:
        pg.allreduce([flags], opts).wait()
    except Exception as exc:  # noqa: BLE001
        raise WeightSyncError(f"weight sync failed during {what}: {type(exc).__name__}: {exc}") from exc
    return [r for r, f in enumerate(flags.tolist()) if f]


def send_weights(tensors: Mapping[str, torch.Tensor], plan: SyncPlan, *, addr: str, port: int, backend: str = "gloo",
                 timeout_s: float = 300.0, device: torch.device | str | None = None, world_size: int = 2) -> SyncReport:
    """Rank 0 of a sync: broadcast ``tensors`` (cast to the plan's dtypes, on any device: each
    is copied into the bucket being packed) bucket by bucket to the ``world_size - 1`` receivers
    meeting at ``addr:port`` (``receive_weights`` / ``receive_buckets``). The buckets are packed
    on ``device`` (None: ``sync_device(backend)``, the rank's GPU for NCCL). Returns the sender's
    report, whose digest is the weight digest (``rft_core.weightsync.digest``, by the backend's
    ``sync_method``) of the weights as sent.

    Raises:
        ValueError: ``device`` is not one ``backend`` moves tensors from (``check_device``),
            before anyone meets.
        WeightSyncError: the tensors do not fit the plan, a receiver's plan differs, a receiver
            failed to land a bucket, or a collective failed or timed out.
    """
    device = check_device(backend, sync_device(backend) if device is None else device)
    check_fits(plan, tensors)
    t0 = time.perf_counter()
    pg = _process_group(backend, addr, port, 0, timeout_s, world_size)
    check = Digest(plan.layout(), sync_method(backend))
    try:
        header = torch.tensor([plan.fingerprint(), len(plan.bucket_sizes)], dtype=torch.int64, device=device)
        _broadcast(pg, header, "the plan check", timeout_s)
        bad = _failed_ranks(pg, 0, world_size, False, device, "the plan check", timeout_s)
        if bad:
            raise WeightSyncError(f"weight sync: receiver rank(s) {bad} refused the sender's weights at the plan check "
                                  "(another layout: names, dtypes or shapes differ; see their error): is the engine's "
                                  "model the policy's architecture?")
        for i in range(len(plan.bucket_sizes)):
            buf = pack_bucket(plan, tensors, i, device)
            _broadcast(pg, buf, f"bucket {i + 1}/{len(plan.bucket_sizes)}", timeout_s)
        bad = _failed_ranks(pg, 0, world_size, False, device, "the end of the transaction", timeout_s)
        if bad:
            raise WeightSyncError(f"weight sync: receiver rank(s) {bad} could not land the weights (see their error)")
    finally:
        del pg
    # after the transfer, while the receivers checksum what landed (not between buckets, where it would hold them up)
    for e in plan.entries:
        check.add(e.name, tensors[e.name].detach().to(device=device, dtype=e.torch_dtype))
    sent = check.hexdigest()
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=sent, backend=backend)


def _receive(plan: SyncPlan, *, addr: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
             device: torch.device, land, check: Digest | None = None, refusal: str | None = None) -> None:
    """The receiving side of one transaction: calls ``land(index, buf)`` for each bucket as it
    arrives (a ``land`` that raises stops further landing, the transaction runs to its end and
    then fails on every rank), and adds every received tensor to ``check`` (None: the caller
    checksums what landed). ``refusal``: this receiver refuses the plan (why): it fails the plan
    check, so every rank stops before a bucket moves."""
    pg = _process_group(backend, addr, port, rank, timeout_s, world_size)
    error: BaseException | None = None
    try:
        header = torch.zeros(2, dtype=torch.int64, device=device)
        _broadcast(pg, header, "the plan check", timeout_s)
        mismatch = int(header[0]) != plan.fingerprint() or int(header[1]) != len(plan.bucket_sizes)
        bad = _failed_ranks(pg, rank, world_size, mismatch or refusal is not None, device, "the plan check", timeout_s)
        if mismatch:
            raise WeightSyncError("the sender's weights have another layout than the receiver's model (names, dtypes "
                                  "or shapes differ): is the engine's model the policy's architecture?")
        if refusal is not None:
            raise WeightSyncError(refusal)
        if bad:
            raise WeightSyncError(f"weight sync: rank(s) {bad} expect another layout than the sender's weights")
        for i, size in enumerate(plan.bucket_sizes):
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            _broadcast(pg, buf, f"bucket {i + 1}/{len(plan.bucket_sizes)}", timeout_s)
            if check is not None:
                for name, t in bucket_views(plan, buf, i):
                    check.add(name, t)
            if error is None:
                try:
                    land(i, buf)
                except Exception as exc:  # noqa: BLE001  reported to every rank below, then raised
                    error = exc
                    where = f"bucket {i + 1}/{len(plan.bucket_sizes)} ({plan.bucket(i)[0].name} .. {plan.bucket(i)[-1].name})"
        bad = _failed_ranks(pg, rank, world_size, error is not None, device, "the end of the transaction", timeout_s)
    finally:
        del pg
    if error is not None:
        raise WeightSyncError(f"weight sync: rank {rank} could not land {where}: {type(error).__name__}: {error}") from error
    if bad:
        raise WeightSyncError(f"weight sync: rank(s) {bad} could not land the weights (see their error)")


def receive_weights(target: Mapping[str, torch.Tensor], plan: SyncPlan, *, addr: str, port: int, backend: str = "gloo",
                    timeout_s: float = 300.0, rank: int = 1, world_size: int = 2) -> SyncReport:
    """A receiver of a sync (rank ``rank`` of ``world_size``): receive every bucket from
    ``send_weights`` and copy it into ``target`` (name -> the receiver's own tensors, e.g.
    ``state_tensors(model)``). Returns the report, whose digest is the weight digest of
    ``target`` as landed (by the backend's ``sync_method``, each tensor as it lands).

    Raises:
        ValueError: ``target`` is on a device ``backend`` cannot move tensors to (``check_device``).
        WeightSyncError: ``target`` does not fit the plan, the sender's plan differs, or a
            collective failed or timed out (``target`` is then partly written: the caller must
            hold it as invalid).
    """
    return receive_into(IntoTensors(target), plan, addr=addr, port=port, backend=backend, timeout_s=timeout_s,
                        rank=rank, world_size=world_size)


def receive_into(landing: IntoTensors, plan: SyncPlan, *, addr: str, port: int, backend: str, timeout_s: float,
                 rank: int = 1, world_size: int = 2) -> SyncReport:
    """``receive_weights`` into ``landing``'s tensors (``IntoTensors.land``: each tensor copied
    and added to the landed digest as its bucket arrives)."""
    check_device(backend, landing.device)
    check_fits(plan, landing.target)
    t0 = time.perf_counter()
    digest = Digest(plan.layout(), sync_method(backend))
    _receive(plan, addr=addr, port=port, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s,
             device=landing.device, land=lambda i, buf: landing.land(plan, i, buf, digest))
    try:
        landed = digest.hexdigest()  # the last pieces' copies finish here
    except Exception as exc:  # noqa: BLE001  a copy that failed on the digest's threads
        raise WeightSyncError(f"weight sync: rank {rank} could not land the weights: {type(exc).__name__}: {exc}") from exc
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=landed, backend=backend)


def receive_buckets(plan: SyncPlan, *, addr: str, port: int, rank: int = 1, world_size: int = 2, backend: str = "gloo",
                    timeout_s: float = 300.0, device: torch.device | str = "cpu",
                    on_bucket: Callable[[list[tuple[str, torch.Tensor]]], Any], refusal: str | None = None) -> SyncReport:
    """A receiver of a sync that holds no tensors of the plan's names (a vLLM worker, an SGLang
    engine): receive every bucket from ``send_weights`` onto ``device`` and call
    ``on_bucket([(name, tensor), ...])`` with the bucket's tensors as it lands (views into the
    bucket with the plan's dtype and shape, valid until ``on_bucket`` returns: it must copy
    what it keeps). ``refusal`` (the engine's check found that the plan does not fit its model):
    this receiver fails the plan check with that message, so every rank stops before a bucket
    moves. Returns the report, whose digest is the weight digest of the received tensors (by the
    backend's ``sync_method``: on ``device`` for NCCL).

    Raises:
        ValueError: ``device`` is not one ``backend`` moves tensors to (``check_device``).
        WeightSyncError: the sender's plan differs, ``refusal`` was given, ``on_bucket`` raised (the transaction runs to
            its end first, so the sender and the other receivers fail at once too; the error
            names the bucket and chains ``on_bucket``'s exception), another rank failed, or a
            collective failed or timed out.
    """
    device = check_device(backend, device)
    t0 = time.perf_counter()
    check = Digest(plan.layout(), sync_method(backend))
    _receive(plan, addr=addr, port=port, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s,
             device=device, land=lambda i, buf: on_bucket(bucket_views(plan, buf, i)), check=check, refusal=refusal)
    received = check.hexdigest()
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=received, backend=backend)


class Collective(Transport):
    """A bucketed broadcast from the trainer's rank 0 over a process group of its own (see the
    module docstring); ``Gloo`` on the CPU, ``NCCL`` between GPUs of different processes. The
    two legs run together (no handoff)."""

    upstream = "torch/distributed/distributed_c10d.py (TCPStore, ProcessGroupGloo, ProcessGroupNCCL)"

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Rank 0: ``send_weights`` over this transport's backend to ``meet.world_size - 1``
        receivers at ``meet.addr:meet.port``, packed on the backend's device (``sync_device``:
        this rank's GPU for NCCL, wherever the weights are: a ZeRO-3 export is on the CPU), each
        wait under ``own_wait_s``."""
        return send_weights(tensors, plan, addr=meet.addr, port=meet.port, backend=self.name,
                            timeout_s=self.own_wait_s, device=sync_device(self.name), world_size=meet.world_size)

    def check(self, landing: Landing, what: str) -> None:
        """NCCL into tensors that are not on a GPU is refused before the sender starts (and waits
        for a receiver that would never join).

        Raises:
            WeightSyncError: that landing.
        """
        if self.name == "nccl" and (landing.device is None or landing.device.type != "cuda"):
            raise WeightSyncError(f"{what}: the policy worker sends over NCCL from its GPU but this receiver's model "
                                  f"is on {landing.device}: give the receiving role a GPU")

    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """Rank 1 of 2: ``receive_into`` the landing's tensors, each wait under ``own_wait_s``.

        Raises:
            TypeError: a landing that is not a model's tensors (an engine receives by its own transport).
            WeightSyncError: the transfer failed or the layouts differ.
        """
        if not isinstance(landing, IntoTensors):
            raise TypeError(f"the {self.name} transport lands in a model's tensors, not in {type(landing).__name__}")
        return receive_into(landing, plan, addr=meet.addr, port=meet.port, backend=self.name,
                            timeout_s=self.own_wait_s)


@register
class Gloo(Collective):
    """The collective transport over gloo: buffers on the CPU."""

    name = "gloo"
    device = "CPU"


@register
class NCCL(Collective):
    """The collective transport over NCCL: buffers on each rank's current GPU."""

    name = "nccl"
    device = "GPU (each rank's current CUDA device)"


COLLECTIVES: dict[str, type[Collective]] = {"gloo": Gloo, "nccl": NCCL}
