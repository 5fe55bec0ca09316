"""The plan, the buckets and the checksum of a weight sync: what every transport of
``rft_core.weightsync`` shares (``base.Transport``).

One transaction moves every tensor of a model's ``state_dict`` in the receiver's dtype:

1. **Plan.** The tensors by name, in the receiver's dtype, packed in order into byte buckets of
   at most ``bucket_mb`` MiB, each tensor on a 64-byte boundary (a tensor larger than a bucket
   gets one of its own): ``SyncPlan.of``, built by both sides from their own model, or by the
   sender alone and handed to a receiver without HF-named tensors (``to_json``/``from_json``).
2. **Buckets.** Each bucket is one flat ``uint8`` tensor (``pack_bucket``); a receiver copies it into
   its tensors (``unpack_bucket``) or hands its tensors (``bucket_views``) to an engine's own loader.
   How the bucket gets from the sender to the receiver is the transport's
   (``rft_core.weightsync.collective``, ``cuda_ipc``, ``shm``, ``local``, ``engine``).
3. **Verification.** Both sides compute the weight digest (``rft_core.weightsync.digest``) of
   the weights as sent and as landed (``SyncReport.digest``) by the method of the transport
   (``digest.sync_method``): over NCCL and CUDA IPC exact sums on the GPU (no copy to the host),
   on the CPU XXH3-128 on the host; the session compares them (``session.pull``).

Devices. The backend, not the tensors, decides where a transaction's buffers live
(``sync_device``): NCCL moves CUDA tensors only (``ProcessGroupNCCL`` refuses CPU ones: "Tensors
must be CUDA and dense"), so over NCCL every bucket is packed on the rank's current CUDA device,
whatever device the weights come from (DeepSpeed ZeRO-3's consolidated state dict is on the
CPU: ``param.detach().cpu()`` in deepspeed/runtime/engine.py, 0.19.8); gloo packs on the CPU.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from rft_core.models.hub import torch_dtype
from rft_core.training.zero import collective_device


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

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype ``dtype`` names (``float32``, ``bfloat16``, ``int64``, ...)."""
        return getattr(torch, self.dtype)


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
        """Bytes of the tensors themselves (what a sync's report counts)."""
        return sum(e.nbytes for e in self.entries)

    def fingerprint(self) -> int:
        """A 63-bit number that differs between plans of different names, dtypes or shapes."""
        text = json.dumps([(e.name, e.dtype, e.shape) for e in self.entries])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def bucket(self, index: int) -> list[SyncEntry]:
        """The entries of bucket ``index``, in order."""
        return [e for e in self.entries if e.bucket == index]

    def layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every entry, in name order (what the weight digest hashes)."""
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
    seconds, buckets, the weight digest of the weights as sent or landed
    (``rft_core.weightsync.digest``), the transport or backend, and what else a transport
    reports (``extra``: a handoff transport's ``handoff``)."""

    bytes: int
    seconds: float
    buckets: int
    digest: str
    backend: str
    extra: dict[str, Any] = field(default_factory=dict)


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


def pack_bucket(plan: SyncPlan, tensors: Mapping[str, torch.Tensor], index: int, device: torch.device) -> torch.Tensor:
    """Bucket ``index`` of ``plan`` as one flat ``uint8`` tensor of ``plan.bucket_sizes[index]``
    bytes on ``device``: each of its entries' tensor from ``tensors`` cast to the entry's dtype
    (the receiver's) and copied to its byte range (what a transport sends).

    Raises:
        KeyError: ``tensors`` lacks a name of the bucket (``check_fits`` first names them all).
    """
    buf = torch.empty(plan.bucket_sizes[index], dtype=torch.uint8, device=device)
    for e in plan.bucket(index):
        src = tensors[e.name].detach().to(device=device, dtype=e.torch_dtype).contiguous().reshape(-1)
        buf[e.offset:e.offset + e.nbytes].copy_(src.view(torch.uint8))
    return buf


def bucket_views(plan: SyncPlan, buf: torch.Tensor, index: int) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of bucket ``index`` of ``plan`` held in the flat uint8 ``buf``:
    views (no copy) with the plan's dtype and shape."""
    return [(e.name, buf[e.offset:e.offset + e.nbytes].view(e.torch_dtype).reshape(e.shape)) for e in plan.bucket(index)]


def unpack_bucket(plan: SyncPlan, buf: torch.Tensor, index: int, target: Mapping[str, torch.Tensor]) -> None:
    """Copy bucket ``index`` of ``plan``, packed in the flat ``uint8`` ``buf`` (``pack_bucket``),
    into the receiver's tensors ``target`` in place (each cast to its tensor's dtype and device
    by ``Tensor.copy_``; no autograd).

    Raises:
        KeyError: ``target`` lacks a name of the bucket (``check_fits`` first names them all).
    """
    with torch.no_grad():
        for name, src in bucket_views(plan, buf, index):
            target[name].copy_(src)


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
