"""The shared-memory transport (``shm``): a weight sync between two processes on the CPU of one
host (the resident policy and rollout workers of a CPU run, two Ray actors), without a process
group or a socket: a handoff through one file in ``/dev/shm`` that both processes map.

The sender packs the plan's buckets into a segment (a ``/dev/shm`` file mapped with
``torch.from_file(path, shared=True)``: buckets back to back, each on a 64-byte boundary) and
digests each tensor as it is packed (XXH3-128, ``rft_core.weightsync.digest.Digest.copy_into``:
8 MiB pieces copied and hashed on the digest's threads, the bytes as sent while still in cache);
its report hands the receiver the segment (path, inode, size, the plan's fingerprint). The
receiver maps the same file (kept mapped for the next sync), copies each tensor into its model
the same way (``IntoTensors.put``) and digests what landed; the session compares the two
digests. Nothing moves through a socket: the sync costs two memory copies and two hashes of the
weights, each leg on every core.

The segment is kept for the next sync (a new one only when the plan's size changes): the pages
of a fresh ``/dev/shm`` file cost a page fault each on first touch (about 1 s for 538 MB on a
loaded 2-core machine, against 0.1 s for a copy into mapped pages). Its space is reserved up
front (``os.posix_fallocate``: a full ``/dev/shm`` fails the send with ``WeightSyncError``
instead of a ``SIGBUS`` on a page write), and ``choose_transport`` picks this transport only
when the sender's ``/dev/shm`` has room for the plan (``Shm.capacity``). A segment is removed
when its transport is closed or collected, or when its process exits; a process killed by
SIGKILL leaves its file, which the next sender on the host removes (its name carries the pid of
its owner: ``sweep``). Both ends must see the same ``/dev/shm``: ``host_id`` names it.

Upstream: ``torch.from_file`` (``torch/_torch_docs.py``, torch 2.13: ``shared=True`` maps the
file ``MAP_SHARED``, so writes reach the file and every other mapping of it), Linux tmpfs
(``/dev/shm``), ``os.posix_fallocate``.
"""
from __future__ import annotations

import errno
import os
import socket
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Mapping

import psutil
import torch

from rft_core.weightsync.base import Meet, Transport, handoff_of, refuse_other_layout, register
from rft_core.weightsync.digest import Digest, sync_method
from rft_core.weightsync.landing import IntoTensors, Landing
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError, bucket_views, check_fits

SHM_DIR = Path("/dev/shm")
PREFIX = "rft-sync-"  # rft-sync-<pid of the owner>-<uuid>
_ALIGN = 64  # bytes: every bucket starts where any dtype can be viewed


def host_id() -> str:
    """This host as far as shared memory goes: its name, its boot id and the device and inode
    of ``SHM_DIR`` (two processes with equal ids map the same ``/dev/shm`` files)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    where = "no-shm"
    if SHM_DIR.is_dir():
        st = os.stat(SHM_DIR)
        where = f"{st.st_dev}:{st.st_ino}"
    return f"{socket.gethostname()}|{boot.read_text().strip() if boot.exists() else ''}|{where}"


def free_bytes() -> int:
    """Bytes free in ``SHM_DIR`` (0 without one)."""
    if not SHM_DIR.is_dir():
        return 0
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def segment_layout(plan: SyncPlan) -> tuple[list[int], int]:
    """(the byte offset of each bucket in the segment, the segment's size): buckets back to
    back, each on a 64-byte boundary."""
    starts, end = [], 0
    for size in plan.bucket_sizes:
        start = -(-end // _ALIGN) * _ALIGN
        starts.append(start)
        end = start + size
    return starts, max(end, 1)


def sweep() -> list[str]:
    """Remove the segments of processes that are gone (killed before they could remove their
    own: ``PREFIX`` + the owner's pid); returns the names removed."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*") if SHM_DIR.is_dir() else ():
        try:
            pid = int(path.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not psutil.pid_exists(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _unlink(path: str) -> None:
    Path(path).unlink(missing_ok=True)


class Segment:
    """A new file of ``size`` bytes in ``SHM_DIR``, its space reserved, mapped as a flat uint8
    tensor (``tensor``); the file is removed by ``close``, when the segment is collected, or at
    the process's exit.

    Raises:
        WeightSyncError: ``SHM_DIR`` has no room for it (``ENOSPC``), or cannot be written.
    """

    def __init__(self, size: int) -> None:
        self.size, self.path = size, str(SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise WeightSyncError(f"shared-memory weight sync: cannot create {self.path}: {exc}") from exc
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            _unlink(self.path)
            why = "no room" if exc.errno == errno.ENOSPC else str(exc)
            raise WeightSyncError(f"shared-memory weight sync: {SHM_DIR} has {why} for {size / 1e6:.0f} MB "
                                  f"({free_bytes() / 1e6:.0f} MB free)") from exc
        finally:
            os.close(fd)
        self.inode = os.stat(self.path).st_ino
        self.tensor = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self._remove = weakref.finalize(self, _unlink, self.path)

    def intact(self) -> bool:
        """Whether the file is still the one mapped (not removed by someone's ``sweep``)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Remove the file (the mapping lives on while a tensor views it)."""
        self._remove()


# the receiver's mappings: path -> ((inode, size), tensor); one sender's segment at a time
_MAPPED: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}


def mapped(path: str, size: int, inode: int) -> torch.Tensor:
    """The segment ``path`` (its first ``size`` bytes) mapped in this process as a flat uint8
    tensor: the mapping kept from the last sync when the file is the same (``inode``).

    Raises:
        WeightSyncError: the file is gone or is not the sender's (another host's ``/dev/shm``,
            a sender that started anew, a sweep).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise WeightSyncError(f"shared-memory weight sync: the sender's segment {path} is not here (is the sender "
                              "on this host, with this /dev/shm?)") from None
    if st.st_ino != inode or st.st_size < size:
        raise WeightSyncError(f"shared-memory weight sync: {path} is not the sender's segment (inode {st.st_ino}, "
                              f"{st.st_size} bytes; the sender has {inode}, {size})")
    key = (inode, size)
    hit = _MAPPED.get(path)
    if hit is not None and hit[0] == key:
        return hit[1]
    _MAPPED.clear()
    tensor = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    _MAPPED[path] = (key, tensor)
    return tensor


@register
class Shm(Transport):
    """Two processes on the CPU of one host, a handoff through a ``/dev/shm`` segment (see the
    module docstring). The sender's segment is kept by its transport object across syncs."""

    name = "shm"
    device = "CPU, one host: a /dev/shm file both processes map"
    upstream = "torch.from_file(shared=True) (torch/_torch_docs.py), Linux tmpfs, os.posix_fallocate"
    handoff = True

    def __init__(self, *, timeout_s: float = 300.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self._segment: Segment | None = None

    def capacity(self) -> int:
        """Bytes a send can use: free in ``SHM_DIR``, plus this transport's own segment (reused)."""
        return free_bytes() + (self._segment.size if self._segment is not None else 0)

    def _segment_for(self, size: int) -> Segment:
        if self._segment is not None and (self._segment.size != size or not self._segment.intact()):
            self.close()
        if self._segment is None:
            sweep()
            self._segment = Segment(size)
        return self._segment

    def send(self, tensors: Mapping[str, torch.Tensor], plan: SyncPlan, meet: Meet) -> SyncReport:
        """Pack ``tensors`` (cast to the plan's dtypes) into the segment, digesting each as packed;
        the report's ``extra["handoff"]`` names the segment.

        Raises:
            WeightSyncError: the tensors do not fit the plan, or ``/dev/shm`` has no room.
        """
        check_fits(plan, tensors)
        t0 = time.perf_counter()
        starts, size = segment_layout(plan)
        segment = self._segment_for(size)
        digest = Digest(plan.layout(), sync_method(self.name))
        for i, start in enumerate(starts):
            for name, view in bucket_views(plan, segment.tensor[start:start + plan.bucket_sizes[i]], i):
                digest.copy_into(name, view, tensors[name])
        sent = digest.hexdigest()  # every piece copied and hashed
        handoff = handoff_of(plan, path=segment.path, inode=segment.inode, size=size, starts=starts)
        return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(starts),
                          digest=sent, backend=self.name, extra={"handoff": handoff})

    def receive(self, plan: SyncPlan, meet: Meet, landing: Landing) -> SyncReport:
        """Map the sender's segment (``meet.handoff``) and copy each tensor into the landing.

        Raises:
            TypeError: a landing that is not a model's tensors.
            WeightSyncError: the layouts differ, the landing does not fit the plan, or the
                segment is not the sender's.
        """
        if not isinstance(landing, IntoTensors):
            raise TypeError(f"the shm transport lands in a model's tensors, not in {type(landing).__name__}")
        handoff: dict[str, Any] = meet.handoff
        refuse_other_layout(plan, handoff)
        check_fits(plan, landing.target)
        t0 = time.perf_counter()
        segment = mapped(handoff["path"], handoff["size"], handoff["inode"])
        digest = Digest(plan.layout(), sync_method(self.name))
        for i, start in enumerate(handoff["starts"]):
            landing.land(plan, i, segment[start:start + plan.bucket_sizes[i]], digest)
        landed = digest.hexdigest()  # every piece copied and hashed
        return SyncReport(bytes=plan.payload_bytes, seconds=time.perf_counter() - t0, buckets=len(plan.bucket_sizes),
                          digest=landed, backend=self.name)

    def finalize(self, meet: Meet) -> None:
        """Nothing: the segment is kept for the next sync (``close`` removes it)."""

    def close(self) -> None:
        """Remove the segment (a later send makes a new one)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None
