"""The one weight digest: what both sides of a weight sync compare, what a weightless update
records (``rft_core.stages.lineage.WEIGHTS_DIGEST_KEY``) and what recovery checks a rebuilt
trainer against. One function (``weights_digest``) and its streaming form (``Digest``), by one
of three methods; the digest string says which method made it (``method_of``), so a recorded
digest is always checked by the method that recorded it:

============ ========================================== ==========================================
method       the string                                 computed
============ ========================================== ==========================================
``xxh3``     ``<16 hex>-xxh3:<32 hex>``                 XXH3-128 (the ``xxhash`` package, xxHash
                                                        0.8) on the host, as a two-level tree: of
                                                        the 16-byte XXH3-128 digests of every
                                                        8 MiB piece of every tensor's bytes, in
                                                        name order (``PIECE_BYTES``): CPU weights
                                                        (since issue 46)
``device``   ``<16 hex>-<16 hex>``                      two exact 31-bit sums on the tensors' own
                                                        device (``rft_core.weightsync.checksum``):
                                                        GPU weights, nothing copied to the host
``sha256``   64 hex                                     hashlib's sha256 over each tensor's
                                                        ``name|dtype|shape|`` and bytes: what CPU
                                                        weights recorded before issue 46 (still
                                                        checked: old runs resume)
============ ========================================== ==========================================

The first 16 hex of ``xxh3`` and ``device`` are the sha256 of the layout (every tensor's name,
dtype and shape, in name order: ``checksum.meta_digest``), so two digests of other layouts never
match (and the layout fixes where each tensor's pieces start and end). Each method sees every
bit: XXH3-128 misses random corruption with probability about 2**-128 per piece, the device
sums about 2**-62 (and a single changed word never: ``checksum``), sha256 2**-256.

The pieces make ``xxh3`` parallel: they are hashed on a small thread pool (``_submit``: xxHash
releases the GIL), and ``Digest.copy_into`` copies a tensor piece by piece on it, each piece
hashed right after its copy (still in cache), which is how a sync lands and packs its tensors.
Speed on one 2-core CPU (2026-11-28, 538 MB, load average 1.9): one XXH3-128 pass 0.07 s, on
two threads 0.04 s; copy and hash together 0.10 s on two threads against 0.12 s for a torch copy
and one hash after it; hashlib's sha256 0.62 s (1.15 s/GB). The device sums on the CPU are
slower still (1.3 s/GB); on a GPU they read the weights where they are (one H200: 0.8 GB in
well under the 1.2 s of a host copy and sha256).
"""
from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Mapping

import torch
import xxhash

from rft_core.weightsync.checksum import combine, meta_digest, word_sums

METHODS = ("xxh3", "device", "sha256")
PIECE_BYTES = 8 << 20  # the leaves of the xxh3 tree: a multiple of every element size
_THREADS = max(1, min(4, os.cpu_count() or 1))  # the threads that hash and copy pieces
_POOL: ThreadPoolExecutor | None = None
# the methods a sync's two sides use, by transport: GPU buffers are checked where they are
_SYNC_METHOD = {"nccl": "device", "cuda_ipc": "device"}
_DEVICE_FORMAT = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{16}$")
_XXH3_FORMAT = re.compile(r"^[0-9a-f]{16}-xxh3:[0-9a-f]{32}$")
_SHA256_FORMAT = re.compile(r"^[0-9a-f]{64}$")


def sync_method(transport: str) -> str:
    """The method both sides of a sync over ``transport`` (a registered transport's name, or the
    collective backend an engine receives over) use: ``device`` over ``nccl`` and ``cuda_ipc``
    (GPU buffers), ``xxh3`` otherwise (``gloo``, ``shm``, ``local``, ...: CPU buffers). Both sides
    know the transport, so they always agree."""
    return _SYNC_METHOD.get(transport, "xxh3")


def method_of(recorded: str) -> str:
    """The method that made the digest string ``recorded`` (the table of the module docstring).

    Raises:
        ValueError: not a digest of any method.
    """
    for method, pattern in (("xxh3", _XXH3_FORMAT), ("device", _DEVICE_FORMAT), ("sha256", _SHA256_FORMAT)):
        if pattern.match(recorded):
            return method
    raise ValueError(f"not a weights digest: {recorded[:80]!r} (known: {', '.join(METHODS)})")


def _forget_pool() -> None:
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)  # a forked child has none of the parent's threads


def _submit(fn, *args) -> Future:
    """``fn(*args)`` on the pieces' threads (up to 4, one per core, made on first use). Also on
    one core: the caller's thread only submits (copying and hashing in the caller's thread,
    between torch's own intra-op threads, measured 3 to 6 times slower on a busy 2-core machine)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="rft-digest")
    return _POOL.submit(fn, *args)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` on the host: a view of a contiguous CPU tensor (no copy), else a copy."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def _leaf(piece: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(piece)


def _copy_leaf(dst: torch.Tensor, src: torch.Tensor) -> bytes:
    """Copy the piece ``src`` into ``dst`` (flat, one dtype each), then hash ``dst``'s bytes."""
    with torch.no_grad():
        dst.copy_(src)
    return _leaf(memoryview(dst.view(torch.uint8).numpy()))


class Digest:
    """The digest of tensors added one by one in the order of ``layout`` ((name, dtype, shape)
    triples in name order: ``SyncPlan.layout()``), e.g. bucket by bucket as they land. Equal to
    ``weights_digest`` of the same tensors by the same method. A tensor added must not change
    until ``hexdigest`` (its pieces may still be hashing).

    Raises:
        ValueError: an unknown method (constructor); a tensor added out of the layout's order
            (``add``); ``hexdigest`` before every tensor was added.
    """

    def __init__(self, layout: Iterable, method: str = "xxh3") -> None:
        if method not in METHODS:
            raise ValueError(f"unknown digest method {method!r}; valid: {', '.join(METHODS)}")
        self.layout, self.method = list(layout), method
        self._order = iter([name for name, _, _ in self.layout])
        self._sums: dict[str, torch.Tensor] = {}
        self._leaves: list[Future] = []
        self._sha = hashlib.sha256() if method == "sha256" else None

    def _next(self, name: str) -> None:
        expected = next(self._order, None)
        if name != expected:
            raise ValueError(f"digest: {name!r} added where the layout has {expected!r} next")

    def add(self, name: str, t: torch.Tensor) -> None:
        """Add the tensor ``name`` (the next one of the layout; any device)."""
        self._next(name)
        if self.method == "device":
            self._sums[name] = word_sums(t)
            return
        if self.method == "sha256":  # the construction recorded before issue 46
            self._sha.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
            if t.numel():
                self._sha.update(_host_bytes(t))
            return
        raw = _host_bytes(t) if t.numel() else memoryview(b"")
        self._leaves += [_submit(_leaf, raw[i:i + PIECE_BYTES]) for i in range(0, len(raw), PIECE_BYTES)]

    def copy_into(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (same shape; cast to ``dst``'s dtype) and add ``dst`` as the
        tensor ``name``: piece by piece on the thread pool for ``xxh3`` (each piece hashed right
        after its copy), else a copy and ``add``."""
        if self.method != "xxh3" or dst.device.type != "cpu" or not dst.is_contiguous() or dst.numel() == 0:
            with torch.no_grad():
                dst.copy_(src)
            self.add(name, dst)
            return
        self._next(name)
        flat, source = dst.view(-1), src.detach().reshape(-1)
        step = PIECE_BYTES // dst.element_size()
        self._leaves += [_submit(_copy_leaf, flat[i:i + step], source[i:i + step])
                         for i in range(0, flat.numel(), step)]

    def hexdigest(self) -> str:
        """The digest string (the module docstring's table); waits for the pieces still hashing."""
        if next(self._order, None) is not None:
            raise ValueError("digest: not every tensor of the layout was added")
        if self.method == "device":
            return combine(self.layout, self._sums)
        if self.method == "sha256":
            return self._sha.hexdigest()
        root = xxhash.xxh3_128(b"".join(f.result() for f in self._leaves)).hexdigest()
        return f"{meta_digest(self.layout)[:16]}-xxh3:{root}"


def layout_of(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of ``tensors``, in name order."""
    return [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in sorted(tensors)]


def weights_digest(tensors: Mapping[str, torch.Tensor], method: str | None = None) -> str:
    """The digest of ``tensors`` (name -> tensor of any dtype, shape and device): names, dtypes,
    shapes and every bit of the values. ``method`` (``METHODS``; None: ``device`` when a tensor
    is on a GPU, else ``xxh3``). Two state dicts have equal digests by one method exactly when
    they hold the same tensors bit for bit (up to the odds of the module docstring).

    Raises:
        ValueError: an unknown method.
    """
    if method is None:
        method = "device" if any(t.is_cuda for t in tensors.values()) else "xxh3"
    d = Digest(layout_of(tensors), method)
    for name in sorted(tensors):
        d.add(name, tensors[name])
    return d.hexdigest()


def digest_like(tensors: Mapping[str, torch.Tensor], recorded: str) -> str:
    """``weights_digest`` of ``tensors`` by the method that made ``recorded`` (``method_of``):
    what recovery compares with a committed digest, whichever device the run resumes on.

    Raises:
        ValueError: ``recorded`` is not a digest.
    """
    return weights_digest(tensors, method_of(recorded))
