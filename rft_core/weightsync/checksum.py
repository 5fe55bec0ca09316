"""The ``device`` method of the weight digest (``rft_core.weightsync.digest``): an exact checksum
of weights computed on their own device, without copying the weights to the host (GPU weights:
what both sides of an NCCL or CUDA IPC sync compare, and what a GPU trainer's weightless update
records).

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
