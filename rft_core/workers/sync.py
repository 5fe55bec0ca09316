"""Weight sync between processes: the trainer's new policy into an inference copy (the rollout
engine, the actor pass) without touching storage.

One transaction moves every tensor of a model's ``state_dict`` in the receiver's dtype:

1. **Plan.** Both sides build the same plan from their own model (``SyncPlan.of``): the
   state-dict entries by name, in the receiver's dtype, packed in order into byte buckets of at
   most ``bucket_mb`` MiB (a tensor larger than a bucket gets a bucket of its own). The sender
   checks that its tensors fit the plan (each tensor starts on a 64-byte boundary); the first message is the plan's fingerprint, so two
   sides with different models stop at once with ``WeightSyncError`` instead of writing bytes
   into the wrong tensors.
2. **Buckets.** Each bucket is one flat ``uint8`` tensor broadcast from rank 0 (the trainer) to
   rank 1 (the engine) over a two-rank process group of its own (``torch.distributed``:
   ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` between two GPUs), created for the sync
   from a ``TCPStore`` rendezvous and destroyed after it. This is how verl, OpenRLHF and NeMo-RL
   move weights into their engines (a dedicated NCCL group next to the training group), here
   with gloo for the CPU. Every collective runs under ``timeout_s``: a peer that is gone or
   hung fails the sync with ``WeightSyncError`` naming the stage of the transaction.
3. **Landing.** The receiver copies each bucket into its tensors as it arrives, so it needs no
   second copy of the model; until the sync has landed and been verified, the caller holds the
   engine's weights as invalid (``rft_core.workers.resident``), so the engine never serves a
   half-updated model: a failed sync leaves it without a version, and the next request syncs
   again.
4. **Verification.** Both sides compute ``weights_digest`` (sha256 over names, dtypes, shapes
   and bytes) of the weights as sent and as landed; the caller compares them.

Two processes on one GPU cannot form an NCCL group (NCCL 2.28 refuses: "Duplicate GPU
detected", docs/gpu.md); such a pair moves weights by CUDA IPC handles instead
(``export_cuda_ipc`` / ``import_cuda_ipc``), as verl's and OpenRLHF's colocated modes do.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from rft_core.models.hub import torch_dtype


def _dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan entry's dtype name (``float32``, ``bfloat16``, ``int64``, ...)."""
    return getattr(torch, name)


class WeightSyncError(RuntimeError):
    """A weight sync failed (timeout, a peer that went away, a plan mismatch or a digest that
    differs after landing). The receiver's weights are then invalid until a sync succeeds."""


_ALIGN = 64  # bytes


@dataclass(frozen=True)
class SyncEntry:
    """One tensor of the plan: its state-dict name, dtype (receiver's), shape and byte range in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SyncPlan:
    """Every tensor of a state dict, in name order, packed into byte buckets (see the module docstring)."""

    entries: tuple[SyncEntry, ...]
    bucket_sizes: tuple[int, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], *, dtype: str | torch.dtype | None = None,
           bucket_mb: float = 256) -> "SyncPlan":
        """The plan of ``tensors`` (name -> tensor), each cast to ``dtype`` if given (floating
        tensors only: integer buffers keep theirs), in buckets of at most ``bucket_mb`` MiB.

        Raises:
            ValueError: ``bucket_mb`` <= 0.
        """
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        limit = int(bucket_mb * 2**20)
        cast = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        entries, sizes = [], [0]
        for name in sorted(tensors):
            t = tensors[name]
            dt = cast if cast is not None and t.is_floating_point() else t.dtype
            nbytes = t.numel() * torch.empty((), dtype=dt).element_size()
            offset = -(-sizes[-1] // _ALIGN) * _ALIGN  # every tensor starts on an aligned byte: a view of its dtype
            if sizes[-1] and offset + nbytes > limit:
                sizes.append(0)
                offset = 0
            entries.append(SyncEntry(name, str(dt).removeprefix("torch."), tuple(t.shape), len(sizes) - 1, offset, nbytes))
            sizes[-1] = offset + nbytes
        return cls(tuple(entries), tuple(sizes))

    @property
    def total_bytes(self) -> int:
        """Bytes moved by one sync, alignment padding included."""
        return sum(self.bucket_sizes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the tensors themselves (what a sync's seconds per GB are counted over)."""
        return sum(e.nbytes for e in self.entries)

    def fingerprint(self) -> int:
        """A 63-bit number that differs between plans of different names, dtypes or shapes."""
        text = json.dumps([(e.name, e.dtype, e.shape) for e in self.entries])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def bucket(self, index: int) -> list[SyncEntry]:
        """The entries of bucket ``index``, in order."""
        return [e for e in self.entries if e.bucket == index]


@dataclass
class SyncReport:
    """What one side of a sync did: bytes of the tensors moved (``SyncPlan.payload_bytes``),
    seconds, buckets and the digest of the weights."""

    bytes: int
    seconds: float
    buckets: int
    digest: str
    backend: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_gb(self) -> float:
        """Seconds per 10^9 bytes moved."""
        return self.seconds / max(self.bytes / 1e9, 1e-12)


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) over every tensor of ``tensors`` in name order: name, dtype, shape and raw
    bytes (CUDA tensors are copied to the host). Two state dicts have the same digest exactly
    when they hold the same tensors bit for bit."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        flat = t.contiguous().reshape(-1).cpu()
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a sync moves: ``model.state_dict(keep_vars=True)`` detached (parameters and
    persistent buffers), each tensor once: a tied weight (one tensor under several names, e.g.
    the embedding and the LM head) under its first name only (copying into it sets them all)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for k, v in model.state_dict(keep_vars=True).items():
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if v.data_ptr() and key in seen:
            continue
        seen.add(key)
        out[k] = v.detach()
    return out


def free_port() -> int:
    """A free TCP port of this host."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """An address of this host that the other Ray workers can reach (127.0.0.1 on one machine)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _process_group(backend: str, addr: str, port: int, rank: int, timeout_s: float):
    """A two-rank process group of its own (not the default group), rank 0 hosting the store."""
    import torch.distributed as dist

    timeout = _dt.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, world_size=2, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    except Exception as exc:  # noqa: BLE001  RuntimeError/DistNetworkError: the peer never came
        raise WeightSyncError(f"weight sync rendezvous at {addr}:{port} (rank {rank}) failed within {timeout_s:g} s: "
                              f"{exc}") from exc
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown weight-sync backend {backend!r}; valid: gloo, nccl")


def _broadcast(pg, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _dt.timedelta(seconds=timeout_s)
    try:
        pg.broadcast([tensor], opts).wait()
    except Exception as exc:  # noqa: BLE001  gloo/NCCL timeouts and closed connections
        raise WeightSyncError(f"weight sync failed during {what}: {type(exc).__name__}: {exc}") from exc


def _pack(plan: SyncPlan, tensors: Mapping[str, torch.Tensor], index: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(plan.bucket_sizes[index], dtype=torch.uint8, device=device)
    for e in plan.bucket(index):
        src = tensors[e.name].detach().to(device=device, dtype=_dtype(e.dtype)).contiguous().reshape(-1)
        buf[e.offset:e.offset + e.nbytes].copy_(src.view(torch.uint8))
    return buf


def _unpack(plan: SyncPlan, buf: torch.Tensor, index: int, target: Mapping[str, torch.Tensor]) -> None:
    for e in plan.bucket(index):
        dst = target[e.name]
        src = buf[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).reshape(e.shape)
        with torch.no_grad():
            dst.copy_(src)


def check_fits(plan: SyncPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``WeightSyncError`` unless ``tensors`` has exactly the plan's names and shapes."""
    names = {e.name for e in plan.entries}
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors))[:3], sorted(set(tensors) - names)[:3]
        raise WeightSyncError(f"the weights do not fit the sync plan (missing {missing}, unexpected {extra})")
    bad = [e.name for e in plan.entries if tuple(tensors[e.name].shape) != e.shape]
    if bad:
        want = next(e.shape for e in plan.entries if e.name == bad[0])
        raise WeightSyncError(f"the weights do not fit the sync plan: {bad[0]!r} has shape "
                              f"{tuple(tensors[bad[0]].shape)}, the plan {want}")


def send_weights(tensors: Mapping[str, torch.Tensor], plan: SyncPlan, *, addr: str, port: int, backend: str = "gloo",
                 timeout_s: float = 300.0, device: torch.device | str = "cpu") -> SyncReport:
    """Rank 0 of a sync: broadcast ``tensors`` (cast to the plan's dtypes) bucket by bucket to
    the receiver waiting at ``addr:port`` (``receive_weights``). Returns the sender's report,
    whose digest is that of the weights as sent.

    Raises:
        WeightSyncError: the tensors do not fit the plan, the receiver's plan differs, or a
            collective failed or timed out.
    """
    check_fits(plan, tensors)
    device = torch.device(device)
    t0 = time.perf_counter()
    pg = _process_group(backend, addr, port, 0, timeout_s)
    try:
        header = torch.tensor([plan.fingerprint(), len(plan.bucket_sizes)], dtype=torch.int64, device=device)
        _broadcast(pg, header, "the plan check", timeout_s)
        for i in range(len(plan.bucket_sizes)):
            buf = _pack(plan, tensors, i, device)
            _broadcast(pg, buf, f"bucket {i + 1}/{len(plan.bucket_sizes)}", timeout_s)
        ok = torch.zeros(1, dtype=torch.int64, device=device)
        _broadcast(pg, ok, "the end of the transaction", timeout_s)
    finally:
        del pg
    seconds = time.perf_counter() - t0
    cast = {e.name: tensors[e.name].detach().to(_dtype(e.dtype)) for e in plan.entries}
    return SyncReport(bytes=plan.payload_bytes, seconds=seconds, buckets=len(plan.bucket_sizes),
                      digest=weights_digest(cast), backend=backend)


def receive_weights(target: Mapping[str, torch.Tensor], plan: SyncPlan, *, addr: str, port: int, backend: str = "gloo",
                    timeout_s: float = 300.0) -> SyncReport:
    """Rank 1 of a sync: receive every bucket from ``send_weights`` and copy it into ``target``
    (name -> the receiver's own tensors, e.g. ``state_tensors(model)``). Returns the report,
    whose digest is that of ``target`` after landing.

    Raises:
        WeightSyncError: ``target`` does not fit the plan, the sender's plan differs, or a
            collective failed or timed out (``target`` is then partly written: the caller must
            hold it as invalid).
    """
    check_fits(plan, target)
    device = next(iter(target.values())).device if target else torch.device("cpu")
    t0 = time.perf_counter()
    pg = _process_group(backend, addr, port, 1, timeout_s)
    try:
        header = torch.zeros(2, dtype=torch.int64, device=device)
        _broadcast(pg, header, "the plan check", timeout_s)
        if int(header[0]) != plan.fingerprint() or int(header[1]) != len(plan.bucket_sizes):
            raise WeightSyncError("the sender's weights have another layout than the receiver's model (names, dtypes "
                                  "or shapes differ): is the engine's model the policy's architecture?")
        for i, size in enumerate(plan.bucket_sizes):
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            _broadcast(pg, buf, f"bucket {i + 1}/{len(plan.bucket_sizes)}", timeout_s)
            _unpack(plan, buf, i, target)
        ok = torch.zeros(1, dtype=torch.int64, device=device)
        _broadcast(pg, ok, "the end of the transaction", timeout_s)
    finally:
        del pg
    seconds = time.perf_counter() - t0
    return SyncReport(bytes=plan.payload_bytes, seconds=seconds, buckets=len(plan.bucket_sizes),
                      digest=weights_digest(target), backend=backend)


def copy_weights(tensors: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], plan: SyncPlan,
                 device: torch.device | str | None = None) -> tuple[SyncReport, SyncReport]:
    """A sync between two models of one process (both workers in one process: tests, the
    no-Ray benchmark driver): the same plan, buckets and digests as ``send_weights`` /
    ``receive_weights``, the bytes copied in memory. Returns (sender report, receiver report).

    Raises:
        WeightSyncError: either side does not fit the plan.
    """
    check_fits(plan, tensors)
    check_fits(plan, target)
    device = torch.device(device) if device is not None else next(iter(target.values())).device
    t0 = time.perf_counter()
    for i in range(len(plan.bucket_sizes)):
        _unpack(plan, _pack(plan, tensors, i, device), i, target)
    seconds = time.perf_counter() - t0
    cast = {e.name: tensors[e.name].detach().to(_dtype(e.dtype)) for e in plan.entries}
    n = len(plan.bucket_sizes)
    return (SyncReport(plan.payload_bytes, seconds, n, weights_digest(cast), "local"),
            SyncReport(plan.payload_bytes, seconds, n, weights_digest(target), "local"))


def export_cuda_ipc(tensors: Mapping[str, torch.Tensor], plan: SyncPlan, device: torch.device | str) -> tuple[list, list]:
    """Sender side of a sync between two processes on one GPU: pack ``tensors`` into the plan's
    buckets on ``device`` and return (handles, buffers). ``handles`` (picklable, one per bucket:
    ``torch.multiprocessing.reductions.reduce_tensor``) go to the receiver; the caller keeps
    ``buffers`` alive until the receiver has imported them.

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
    """Receiver side of ``export_cuda_ipc``: open each bucket's handle and copy it into ``target``."""
    check_fits(plan, target)
    t0 = time.perf_counter()
    for i, (rebuild, args) in enumerate(handles):
        _unpack(plan, rebuild(*args), i, target)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=weights_digest(target), backend="cuda_ipc")
