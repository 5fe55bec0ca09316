"""An exact checksum of weights computed on their own device (``sync_checksum``): what both
sides of a weight sync compare, without copying the weights to the host.

The bytes of each tensor are read as little-endian signed 16-bit words w_i (-2**15 <= w_i <
2**15; an odd byte count gets one zero byte), cut into rows of ``CHUNK`` = 2**22 words (the
last row shorter). For each of two independent multiplier sets s = 0, 1 (``multipliers``):

    R_s(r) = (sum_j w_(r, j) * b_s(j)) mod 2**31      (row r, in-row position j)
    sum_s  = (sum_r R_s(r) * c_s(r)) mod 2**31

with odd in-row multipliers 1 <= b_s(j) < 2**15 and odd row weights 1 <= c_s(r) < 2**31. The
overflow bound: |w * b| < 2**30 and a row has at most 2**22 words, so every partial sum of a
row is an integer of magnitude below 2**52 < 2**53: the row sums of both sets are one float64
matrix product (words (rows, CHUNK) @ multipliers (CHUNK, 2)), exact in any summation order
(BLAS on CPU, cuBLAS on CUDA), then converted to int64. Each R_s(r) * c_s(r) is below 2**62 and
is reduced mod 2**31 before the (at most ``GROUP // CHUNK`` = 2) rows of one step are added,
and the running sum is reduced after each step. The reduction is ``& (2**31 - 1)`` on two's
complement int64: the residue mod 2**31 of negative sums too. Every step is exact, so the result
is identical on CPU and CUDA; only two integers per tensor reach the host.

The tensors' sums are combined on the host: ``S_s = sum_k T_k * sum_s(k) mod 2**31`` over the
tensors k in name order, with an odd per-name weight T_k < 2**31 (sha256 of the name); names,
dtypes and shapes enter through a sha256 of those strings. The checksum is
``"<16 hex of that sha256>-<S_0 as 8 hex><S_1 as 8 hex>"``.

A single changed word changes both S_s with certainty: it adds d * b * c * T to S_s (mod 2**31)
with b, c, T odd and 0 < |d| < 2**16, which is not a multiple of 2**31. Random corruption goes
unnoticed with probability about 2**-62 (two independent 31-bit sums).
"""
from __future__ import annotations

import functools
import hashlib
from typing import Mapping

import torch

M31 = (1 << 31) - 1
CHUNK = 1 << 22  # words per row: |row sum| < 2**22 * 2**30 = 2**52
GROUP = 2 * CHUNK  # words widened to float64 at once (64 MiB)
# (a, b) of the in-row multiplier hash and (c, d) of the row-weight hash, per set: odd, < 2**31
_SETS = ((0x2545F491, 0x6A09E667, 0x3C6EF373, 0x510E527F), (0x1B873593, 0x4F1BBCDD, 0x5BE0CD19, 0x1F83D9AB))


def _mix(x, a: int, b: int):
    """A 31-bit integer hash of ``x`` (an int or an int64 tensor, values in [0, 2**31)): every
    intermediate stays below 2**63 ((x + a) < 2**32, times b < 2**31)."""
    x = ((x + a) * b) & M31
    x = x ^ (x >> 16)
    x = (x * a) & M31
    return x ^ (x >> 15)


def multipliers(positions, which: int):
    """The in-row multipliers b_which(j) of the in-row positions ``positions`` (an int or an
    int64 tensor, 0 <= j < CHUNK): ``2 * (mix(j, a, b) >> 17) + 1``, odd, in [1, 2**15)."""
    a, b, _, _ = _SETS[which]
    return ((_mix(positions, a, b) >> 17) << 1) | 1


def row_weights(rows, which: int):
    """The row weights c_which(r) of the rows ``rows`` (an int or an int64 tensor, r >= 0):
    ``mix(r, c, d) | 1``, odd, in [1, 2**31)."""
    _, _, c, d = _SETS[which]
    return _mix(rows, c, d) | 1


@functools.lru_cache(maxsize=8)
def _bases(device: str) -> torch.Tensor:
    """(b_0(j), b_1(j)) for j in [0, CHUNK) as a float64 (CHUNK, 2) matrix on ``device`` (64 MiB, kept)."""
    j = torch.arange(CHUNK, dtype=torch.int64, device=device)
    return torch.stack([multipliers(j, 0), multipliers(j, 1)], dim=1).to(torch.float64)


@functools.lru_cache(maxsize=16)
def _row_weight_table(device: str, rows: int) -> torch.Tensor:
    """(c_0(r), c_1(r)) for r in [0, rows) as an int64 (rows, 2) matrix on ``device`` (kept: the
    row weights of every tensor come from it instead of ~20 small kernels per tensor)."""
    r = torch.arange(rows, dtype=torch.int64, device=device)
    return torch.stack([row_weights(r, 0), row_weights(r, 1)], dim=1)


def _row_weight_rows(device: str, first: int, n: int) -> torch.Tensor:
    """Rows ``first`` .. ``first + n - 1`` of the row weights (``_row_weight_table``, sized to a
    power of two of at least 64 rows, so a few tables serve every tensor)."""
    size = max(64, 1 << (first + n - 1).bit_length())
    return _row_weight_table(device, size)[first:first + n]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat int16 tensor on its device (a view where possible)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    if b.storage_offset() % 2:
        b = b.clone()
    return b.view(torch.int16)


def word_sums(t: torch.Tensor) -> torch.Tensor:
    """The two 31-bit sums of ``t`` (see the module docstring) as an int64 tensor of shape (2,)
    on ``t``'s device; nothing is copied to the host."""
    w = _words(t)
    device = str(w.device)
    bases = _bases(device)
    out = None
    for start in range(0, w.numel(), GROUP):
        seg = w[start:start + GROUP].to(torch.float64)
        full, tail = divmod(seg.numel(), CHUNK)
        parts = [seg[:full * CHUNK].view(full, CHUNK) @ bases] if full else []
        if tail:
            parts.append((seg[full * CHUNK:] @ bases[:tail]).reshape(1, 2))
        r = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.int64) & M31  # (rows, 2): R_s(r), exact
        weights = _row_weight_rows(device, start // CHUNK, r.shape[0])
        step = ((r * weights) & M31).sum(0)
        out = step & M31 if out is None else (out + step) & M31
    return torch.zeros(2, dtype=torch.int64, device=w.device) if out is None else out


def meta_digest(layout) -> str:
    """sha256 (hex) of the (name, dtype, shape) triples ``layout``, in the given order."""
    h = hashlib.sha256()
    for name, dtype, shape in layout:
        h.update(f"{name}|{str(dtype).removeprefix('torch.')}|{tuple(shape)}\n".encode())
    return h.hexdigest()


def name_weight(name: str) -> int:
    """T of a tensor name: the first 4 bytes of its sha256 (little-endian), made odd, below 2**31."""
    return (int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") | 1) & M31


def combine(layout, sums: Mapping[str, torch.Tensor]) -> str:
    """The checksum string of tensors whose (name, dtype, shape) triples are ``layout`` (name
    order) and whose ``word_sums`` are ``sums`` (name -> (2,) int64 tensor, any device): one
    host copy of the sums per device.

    Raises:
        KeyError: a name of ``layout`` has no sums.
    """
    layout = list(layout)
    by_device: dict[torch.device, list[str]] = {}
    for name, _, _ in layout:
        by_device.setdefault(sums[name].device, []).append(name)
    host: dict[str, list[int]] = {}
    for names in by_device.values():
        host.update(zip(names, torch.stack([sums[n] for n in names]).tolist()))
    total = [0, 0]
    for name, _, _ in layout:
        for s in (0, 1):
            total[s] = (total[s] + name_weight(name) * host[name][s]) & M31
    return f"{meta_digest(layout)[:16]}-{total[0]:08x}{total[1]:08x}"


METHODS = ("device", "sha256")


def checksum_method(backend: str) -> str:
    """How both sides of a sync over ``backend`` checksum the weights: ``sha256`` on the host
    for ``gloo`` and ``local`` (CPU tensors: hashlib's sha256 runs at 0.7 s/GB on this 2-core
    CPU, the device sums at 1.3 s/GB), ``device`` sums for ``nccl`` and ``cuda_ipc`` (GPU tensors
    are checked where they are). Both sides know the backend, so they always agree."""
    return "sha256" if backend in ("gloo", "local") else "device"


class Checksum:
    """The checksum of tensors added one by one in name order (``layout``'s), bucket by bucket.

    ``device``: the sums of the module docstring (``word_sums``, on each tensor's device).
    ``sha256``: sha256 over the layout's digest and every tensor's bytes, on the host (a CUDA
    tensor is copied there). The result is ``"<16 hex of the layout's sha256>-<the method's
    value>"``; the two methods' strings never equal each other.

    Raises:
        ValueError: an unknown method, or a tensor added out of the layout's order (``add``).
    """

    def __init__(self, layout, method: str = "device") -> None:
        if method not in METHODS:
            raise ValueError(f"unknown checksum method {method!r}; valid: {', '.join(METHODS)}")
        self.layout, self.method = list(layout), method
        self._order = iter([name for name, _, _ in self.layout])
        self._sums: dict[str, torch.Tensor] = {}
        self._sha = hashlib.sha256(meta_digest(self.layout).encode()) if method == "sha256" else None

    def add(self, name: str, t: torch.Tensor) -> None:
        """Add the tensor ``name`` (the next one of the layout)."""
        expected = next(self._order, None)
        if name != expected:
            raise ValueError(f"checksum: {name!r} added where the layout has {expected!r} next")
        if self._sha is None:
            self._sums[name] = word_sums(t)
            return
        flat = t.detach().contiguous().reshape(-1).cpu()
        if flat.numel():
            self._sha.update(memoryview(flat.view(torch.uint8).numpy()))

    def hexdigest(self) -> str:
        """The checksum string (every tensor of the layout must have been added)."""
        if self._sha is None:
            return combine(self.layout, self._sums)
        if next(self._order, None) is not None:
            raise ValueError("checksum: not every tensor of the layout was added")
        return f"{meta_digest(self.layout)[:16]}-sha256:{self._sha.hexdigest()}"


def sync_checksum(tensors: Mapping[str, torch.Tensor], method: str = "device") -> str:
    """The exact checksum of ``tensors`` (name -> tensor of any dtype and shape, each on its own
    device): names, dtypes, shapes and every bit of the values. ``device`` (the default) is
    computed on the tensors' devices (GPU-side for CUDA tensors; the same string on CPU and CUDA
    for the same bits); see the module docstring for the formula, its overflow bound and what
    it detects. ``sha256``: on the host (``Checksum``).

    Returns:
        ``"<16 hex>-<16 hex>"`` (device: the layout's sha256 prefix, then the two 31-bit sums),
        or ``"<16 hex>-sha256:<64 hex>"``.
    """
    names = sorted(tensors)
    c = Checksum([(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], method)
    for n in names:
        c.add(n, tensors[n])
    return c.hexdigest()
