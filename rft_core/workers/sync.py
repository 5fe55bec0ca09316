"""Weight sync between processes: the trainer's new policy into an inference copy (the rollout
engine, the actor pass) without touching storage.

One transaction moves every tensor of a model's ``state_dict`` in the receiver's dtype:

1. **Plan.** The tensors by name, in the receiver's dtype, packed in order into byte buckets of
   at most ``bucket_mb`` MiB, each tensor on a 64-byte boundary (a tensor larger than a bucket
   gets one of its own): ``SyncPlan.of``, built by both sides from their own model, or by the
   sender alone and handed to a receiver without HF-named tensors (``to_json``/``from_json``).
   The first message is the plan's fingerprint, so sides with different models stop at once.
2. **Buckets.** Each bucket is one flat ``uint8`` tensor broadcast from rank 0 (the trainer) to
   ranks 1 .. world_size - 1 (the engine: one rank, or one per tensor-parallel worker of a vLLM
   engine) over a process group of its own (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL``
   between GPUs) from a ``TCPStore`` rendezvous, destroyed after it: how verl, OpenRLHF and
   NeMo-RL move weights into their engines. Every collective runs under ``timeout_s``; after
   the plan check and at the end each rank reports whether it failed (an all-reduce of one flag
   per rank), so all ranks stop together with ``WeightSyncError`` naming the failed ranks.
3. **Landing.** The receiver copies each bucket into its tensors as it arrives
   (``receive_weights``) or hands the bucket's tensors to the engine's own loader
   (``receive_buckets``: vLLM and SGLang map HF names to their fused, sharded parameters), so
   it needs no second copy of the model. Until the sync has landed and been verified the
   caller holds the engine's weights as invalid: a failed sync is never served.
4. **Verification.** Both sides compute ``sync_checksum`` of the weights as sent and as landed
   (``SyncReport.digest``) by the method of the backend (``checksum_method``): over NCCL and
   CUDA IPC exact sums on the GPU (``rft_core.workers.checksum``, no copy to the host), over
   gloo and in one CPU process hashlib's sha256 on the host (twice as fast on a CPU); the
   caller compares them. ``weights_digest`` (sha256 on the host) is what commits record.

Devices. The backend, not the tensors, decides where a transaction's buffers live
(``sync_device``): NCCL moves CUDA tensors only (``ProcessGroupNCCL`` refuses CPU ones: "Tensors
must be CUDA and dense"), so over NCCL every bucket is packed on the rank's current CUDA device,
whatever device the weights come from (DeepSpeed ZeRO-3's consolidated state dict is on the
CPU: ``param.detach().cpu()`` in deepspeed/runtime/engine.py, 0.19.8); gloo packs on the CPU.
Only one bucket at a time is on the device, as OpenRLHF's and verl's ZeRO-3 broadcasts (one
``GatheredParameters`` at a time) keep it. A CPU device for NCCL is refused before anyone meets.

Failures under NCCL. ``ProcessGroupNCCL``'s ``Work.wait()`` does not block the CPU by default,
and its watchdog thread tears the whole process down when a collective fails or times out
(``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, torch 2.13). The sync's own NCCL group is therefore
built with ``TORCH_NCCL_BLOCKING_WAIT=1`` (read once by the group's constructor; set only around
it, so no other group of the process changes): no watchdog runs for it, ``wait()`` blocks the
CPU and raises ``DistBackendError`` after ``timeout_s``, which becomes ``WeightSyncError``. The
one wait not covered is NCCL's communicator setup at the first collective (``ncclCommInitRank``
blocks while a peer that met at the rendezvous never arrives); the Ray-level ``sync_timeout_s``
of the caller bounds it.

Two processes on one GPU cannot form an NCCL group (NCCL 2.28 refuses: "Duplicate GPU
detected", docs/gpu.md); such a pair moves weights by CUDA IPC handles instead
(``rft_core.workers.cuda_ipc``), as verl's and OpenRLHF's colocated modes do.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from rft_core.models.hub import torch_dtype
from rft_core.training.zero import collective_device
from rft_core.workers.checksum import Checksum, checksum_method, combine, sync_checksum, word_sums  # noqa: F401 - re-exported


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

    def layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every entry, in name order (what ``sync_checksum`` hashes)."""
        return [(e.name, e.dtype, e.shape) for e in self.entries]

    def to_json(self) -> str:
        """The plan as JSON text (``from_json`` gives back an equal plan): for a receiver that
        has no HF-named copy of the model to build the plan from (a vLLM or SGLang engine)."""
        return json.dumps({"format": 1, "bucket_sizes": list(self.bucket_sizes),
                           "entries": [[e.name, e.dtype, list(e.shape), e.bucket, e.offset, e.nbytes]
                                       for e in self.entries]})

    @classmethod
    def from_json(cls, text: str) -> "SyncPlan":
        """The plan of ``to_json``'s ``text``.

        Raises:
            ValueError: not a plan's JSON (malformed, another format, an unknown dtype).
        """
        try:
            data = json.loads(text)
            if data.get("format") != 1:
                raise ValueError(f"unknown sync plan format {data.get('format')!r}")
            entries = tuple(SyncEntry(str(n), str(dt), tuple(int(x) for x in shape), int(b), int(o), int(nb))
                            for n, dt, shape, b, o, nb in data["entries"])
            plan = cls(entries, tuple(int(x) for x in data["bucket_sizes"]))
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a sync plan's JSON: {exc}") from exc
        bad = [e.dtype for e in entries if not isinstance(getattr(torch, e.dtype, None), torch.dtype)]
        if bad:
            raise ValueError(f"sync plan has unknown dtype(s) {bad[:3]}")
        return plan


@dataclass
class SyncReport:
    """What one side of a sync did: bytes of the tensors moved (``SyncPlan.payload_bytes``),
    seconds, buckets and the digest of the weights (their ``sync_checksum``)."""

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


def _process_group(backend: str, addr: str, port: int, rank: int, timeout_s: float, world_size: int = 2):
    """A process group of ``world_size`` ranks of its own (not the default group), rank 0
    hosting the ``TCPStore`` (``torch.distributed.TCPStore``, ``ProcessGroupGloo``,
    ``ProcessGroupNCCL``: torch/distributed/distributed_c10d.py).

    Raises:
        WeightSyncError: not every rank met at ``addr:port`` within ``timeout_s``.
        ValueError: an unknown backend, or ``rank`` outside 0 .. world_size - 1.
    """
    import torch.distributed as dist

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"weight sync rank {rank} of world size {world_size}: need 0 <= rank < world_size, world_size >= 2")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown weight-sync backend {backend!r}; valid: gloo, nccl")
    timeout = _dt.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, world_size=world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=True)
    except Exception as exc:  # noqa: BLE001  RuntimeError/DistNetworkError: a peer never came
        raise WeightSyncError(f"weight sync rendezvous at {addr}:{port} (rank {rank} of {world_size}) failed within "
                              f"{timeout_s:g} s: {exc}") from exc
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
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


def sync_device(backend: str) -> torch.device:
    """Where the buffers of a transaction over ``backend`` live: this rank's current CUDA device
    for ``nccl`` (``rft_core.training.zero.collective_device``), the CPU for ``gloo``."""
    return collective_device(backend)


def check_device(backend: str, device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, refused when ``backend`` cannot move tensors there.

    Raises:
        ValueError: a non-CUDA device for ``nccl`` (``ProcessGroupNCCL`` takes CUDA tensors only).
    """
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"weight sync over nccl from/to {device}: NCCL moves CUDA tensors only (ProcessGroupNCCL "
                         "refuses CPU tensors); pack on the rank's GPU (sync_device('nccl')), or sync over gloo")
    return device


def _broadcast(pg, tensor: torch.Tensor, what: str, timeout_s: float) -> None:
    import torch.distributed as dist

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
    import torch.distributed as dist

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


def _pack(plan: SyncPlan, tensors: Mapping[str, torch.Tensor], index: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(plan.bucket_sizes[index], dtype=torch.uint8, device=device)
    for e in plan.bucket(index):
        src = tensors[e.name].detach().to(device=device, dtype=_dtype(e.dtype)).contiguous().reshape(-1)
        buf[e.offset:e.offset + e.nbytes].copy_(src.view(torch.uint8))
    return buf


def bucket_views(plan: SyncPlan, buf: torch.Tensor, index: int) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of bucket ``index`` of ``plan`` held in the flat uint8 ``buf``:
    views (no copy) with the plan's dtype and shape."""
    return [(e.name, buf[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).reshape(e.shape)) for e in plan.bucket(index)]


def _unpack(plan: SyncPlan, buf: torch.Tensor, index: int, target: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, src in bucket_views(plan, buf, index):
            target[name].copy_(src)


def buffers_checksum(plan: SyncPlan, buffers: Iterable[torch.Tensor]) -> str:
    """``sync_checksum`` of the tensors held in ``plan``'s packed buckets ``buffers`` (one flat
    uint8 tensor per bucket, e.g. ``export_cuda_ipc``'s): computed on the buffers' device, equal
    to ``sync_checksum`` of the tensors packed into them."""
    check = Checksum(plan.layout(), "device")
    for i, buf in enumerate(buffers):
        for name, t in bucket_views(plan, buf, i):
            check.add(name, t)
    return check.hexdigest()


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
                 timeout_s: float = 300.0, device: torch.device | str | None = None, world_size: int = 2) -> SyncReport:
    """Rank 0 of a sync: broadcast ``tensors`` (cast to the plan's dtypes, on any device: each
    is copied into the bucket being packed) bucket by bucket to the ``world_size - 1`` receivers
    meeting at ``addr:port`` (``receive_weights`` / ``receive_buckets``). The buckets are packed
    on ``device`` (None: ``sync_device(backend)``, the rank's GPU for NCCL). Returns the sender's
    report, whose digest is the ``sync_checksum`` of the weights as sent (computed on ``device``).

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
    check = Checksum(plan.layout(), checksum_method(backend))
    try:
        header = torch.tensor([plan.fingerprint(), len(plan.bucket_sizes)], dtype=torch.int64, device=device)
        _broadcast(pg, header, "the plan check", timeout_s)
        bad = _failed_ranks(pg, 0, world_size, False, device, "the plan check", timeout_s)
        if bad:
            raise WeightSyncError(f"weight sync: receiver rank(s) {bad} refused the sender's weights at the plan check "
                                  "(another layout: names, dtypes or shapes differ; see their error): is the engine's "
                                  "model the policy's architecture?")
        for i in range(len(plan.bucket_sizes)):
            buf = _pack(plan, tensors, i, device)
            _broadcast(pg, buf, f"bucket {i + 1}/{len(plan.bucket_sizes)}", timeout_s)
        bad = _failed_ranks(pg, 0, world_size, False, device, "the end of the transaction", timeout_s)
        if bad:
            raise WeightSyncError(f"weight sync: receiver rank(s) {bad} could not land the weights (see their error)")
    finally:
        del pg
    # after the transfer, while the receivers checksum what landed (not between buckets, where it would hold them up)
    for e in plan.entries:
        check.add(e.name, tensors[e.name].detach().to(device=device, dtype=_dtype(e.dtype)))
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=check.hexdigest(), backend=backend)


def _receive(plan: SyncPlan, *, addr: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
             device: torch.device, land, check: Checksum | None = None, refusal: str | None = None) -> None:
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
    ``state_tensors(model)``). Returns the report, whose digest is the ``sync_checksum`` of
    ``target`` after landing (on ``target``'s device).

    Raises:
        ValueError: ``target`` is on a device ``backend`` cannot move tensors to (``check_device``).
        WeightSyncError: ``target`` does not fit the plan, the sender's plan differs, or a
            collective failed or timed out (``target`` is then partly written: the caller must
            hold it as invalid).
    """
    device = next(iter(target.values())).device if target else torch.device("cpu")
    check_device(backend, device)
    check_fits(plan, target)
    t0 = time.perf_counter()
    _receive(plan, addr=addr, port=port, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s,
             device=device, land=lambda i, buf: _unpack(plan, buf, i, target))
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=sync_checksum(target, checksum_method(backend)), backend=backend)


def receive_buckets(plan: SyncPlan, *, addr: str, port: int, rank: int = 1, world_size: int = 2, backend: str = "gloo",
                    timeout_s: float = 300.0, device: torch.device | str = "cpu",
                    on_bucket: Callable[[list[tuple[str, torch.Tensor]]], Any], refusal: str | None = None) -> SyncReport:
    """A receiver of a sync that holds no tensors of the plan's names (a vLLM worker, an SGLang
    engine): receive every bucket from ``send_weights`` onto ``device`` and call
    ``on_bucket([(name, tensor), ...])`` with the bucket's tensors as it lands (views into the
    bucket with the plan's dtype and shape, valid until ``on_bucket`` returns: it must copy
    what it keeps). ``refusal`` (the engine's check found that the plan does not fit its model):
    this receiver fails the plan check with that message, so every rank stops before a bucket
    moves. Returns the report, whose digest is the ``sync_checksum`` of the received tensors
    (computed on ``device``).

    Raises:
        ValueError: ``device`` is not one ``backend`` moves tensors to (``check_device``).
        WeightSyncError: the sender's plan differs, ``refusal`` was given, ``on_bucket`` raised (the transaction runs to
            its end first, so the sender and the other receivers fail at once too; the error
            names the bucket and chains ``on_bucket``'s exception), another rank failed, or a
            collective failed or timed out.
    """
    device = check_device(backend, device)
    t0 = time.perf_counter()
    check = Checksum(plan.layout(), checksum_method(backend))
    _receive(plan, addr=addr, port=port, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s,
             device=device, land=lambda i, buf: on_bucket(bucket_views(plan, buf, i)), check=check, refusal=refusal)
    return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                      digest=check.hexdigest(), backend=backend)


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
        buf = _pack(plan, tensors, i, device)
        for name, t in bucket_views(plan, buf, i):
            check.add(name, t)
        _unpack(plan, buf, i, target)
    seconds = time.perf_counter() - t0
    n = len(plan.bucket_sizes)
    return (SyncReport(plan.payload_bytes, seconds, n, check.hexdigest(), "local"),
            SyncReport(plan.payload_bytes, seconds, n, sync_checksum(target, method), "local"))
