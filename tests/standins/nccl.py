"""A stand-in for ``torch.distributed.ProcessGroupNCCL`` (torch 2.13,
``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``) whose bytes move over a
``ProcessGroupGloo``, for a machine without GPUs.

Copied behaviour:

- **CUDA tensors only.** Every collective first runs ``check_gpu_single_tensor``: a tensor that is
  not CUDA is refused with ``ValueError("Tensors must be CUDA and dense")``.
- **One GPU per rank.** The communicator's first collective fails on every rank when two ranks
  sit on one physical device (NCCL's ``init.c``: "Duplicate GPU detected : rank 1 and rank 0
  both on CUDA device ..."; torch raises it as ``DistBackendError``). The rank's device is
  ``torch.cuda.current_device()`` when the first collective runs, told apart by the device's
  UUID (``torch.cuda.get_device_properties(i).uuid``).
- **Errors are asynchronous.** The constructor reads ``TORCH_NCCL_BLOCKING_WAIT`` (default off)
  and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (default 3, ``SkipCleanUp``) from the environment,
  once. Without blocking wait, ``Work.wait()`` does not block the CPU and a collective that times
  out or fails is caught by the watchdog thread, which (error handling 1 or 3) takes the whole
  process down: "Some NCCL operations have failed or timed out. ... To avoid data
  inconsistency, we are taking the entire process down." Nothing the caller could catch is
  raised. With blocking wait the watchdog thread still runs (torch starts one for every group)
  but its error handling is off (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is ignored for the group):
  it takes nothing down, and ``wait()`` blocks the CPU and raises ``DistBackendError`` when the
  collective fails or exceeds its timeout.
- **Lazy communicator.** The constructor connects nothing; the first collective does.

Modelled, not real:

- The process teardown is ``WatchdogTeardown``, a ``BaseException`` (so no ``except Exception``
  of the code under test catches it), raised in the thread that waits on the failed work: the
  test sees "the process would have died here".
- This machine has no CUDA tensors, so the CPU refusal would refuse everything. A test about
  what happens *inside* NCCL's transport (timeouts, teardown, duplicate devices) declares host
  memory as the GPU's with ``host_memory_is_gpu()``; the CPU refusal is tested on its own.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os

import torch
import torch.distributed as dist

_CVAR_TRUE = ("1", "y", "yes", "true", "on")  # c10's getCvarBool (torch/csrc/distributed/c10d/Utils.hpp)


class WatchdogTeardown(BaseException):  # noqa: N818  the process is gone, not an error to handle
    """ProcessGroupNCCL's watchdog tore the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3)."""


@contextlib.contextmanager
def host_memory_is_gpu():
    """Inside: CPU tensors pass the stand-in's CUDA check (process-wide, every thread)."""
    StandInNCCL.host_is_gpu += 1
    try:
        yield
    finally:
        StandInNCCL.host_is_gpu -= 1


def check_gpu_single_tensor(tensor: torch.Tensor) -> None:
    """ProcessGroupNCCL.cpp's check of every tensor handed to a collective."""
    if (tensor.device.type != "cuda" and not StandInNCCL.host_is_gpu) or tensor.is_sparse:
        raise ValueError("Tensors must be CUDA and dense")
    if not tensor.is_contiguous():
        raise ValueError("Tensors must be contiguous")


def check_gpu_device(device: torch.device | str) -> None:
    """``check_gpu_single_tensor`` of the buffers a sender packs on ``device``."""
    if torch.device(device).type != "cuda" and not StandInNCCL.host_is_gpu:
        raise ValueError("Tensors must be CUDA and dense")


def _device_uuid() -> str:
    index = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


class _Work:
    """``WorkNCCL``: ``wait()`` as described in the module docstring."""

    def __init__(self, group: "StandInNCCL", inner, what: str):
        self.group, self.inner, self.what = group, inner, what

    def wait(self, timeout: _dt.timedelta | None = None) -> bool:
        try:
            self.inner.wait()
        except Exception as exc:  # noqa: BLE001  gloo's timeout or closed connection
            if self.group.blocking_wait:
                raise dist.DistBackendError(f"[Rank {self.group.rank}] Work {self.what} failed or timed out in blocking "
                                            f"wait (TORCH_NCCL_BLOCKING_WAIT=1): {exc}") from exc
            if self.group.async_error_handling in (1, 3):
                raise WatchdogTeardown(
                    f"[Rank {self.group.rank}] Some NCCL operations have failed or timed out. Due to the asynchronous "
                    "nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data. To avoid "
                    f"data inconsistency, we are taking the entire process down. ({self.what}: {exc})") from exc
            raise AssertionError("TORCH_NCCL_ASYNC_ERROR_HANDLING 0/2 leave the process hanging: not modelled") from exc
        return True


class StandInNCCL:
    """``ProcessGroupNCCL(store, rank, size, options)`` (see the module docstring). Instances
    are recorded in ``StandInNCCL.made`` (tests read ``blocking_wait`` from them)."""

    host_is_gpu = 0
    made: list["StandInNCCL"] = []

    class Options:
        """``ProcessGroupNCCL.Options``: the op timeout in ``_timeout``."""

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self._timeout = _dt.timedelta(minutes=10)
            self.is_high_priority_stream = is_high_priority_stream

    def __init__(self, store, rank: int, size: int, options: "StandInNCCL.Options | None" = None) -> None:
        self.blocking_wait = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").strip().lower() in _CVAR_TRUE
        self.async_error_handling = int(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
        self.store, self.rank, self.size = store, rank, size
        self.timeout = (options or StandInNCCL.Options())._timeout
        self._gloo = None
        StandInNCCL.made.append(self)

    def _communicator(self):
        """The first collective: every rank says which physical GPU it is on; a duplicate fails them all."""
        if self._gloo is None:
            uuid = _device_uuid()
            self.store.set(f"nccl-standin-device-{self.rank}", uuid)
            others = {r: self.store.get(f"nccl-standin-device-{r}").decode() for r in range(self.size)}
            same = sorted(r for r, u in others.items() if u == uuid and r != self.rank)
            if same:
                raise dist.DistBackendError(f"NCCL error: invalid usage. Last error: Duplicate GPU detected : rank "
                                            f"{self.rank} and rank {same[0]} both on CUDA device {uuid}")
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), self.rank, self.size, self.timeout)
        return self._gloo

    def broadcast(self, tensors, opts):
        for t in tensors:
            check_gpu_single_tensor(t)
        return _Work(self, self._communicator().broadcast(tensors, opts), "broadcast")

    def allreduce(self, tensors, opts):
        for t in tensors:
            check_gpu_single_tensor(t)
        return _Work(self, self._communicator().allreduce(tensors, opts), "allreduce")


@contextlib.contextmanager
def nccl_standin(monkeypatch):
    """``torch.distributed.ProcessGroupNCCL`` replaced by ``StandInNCCL`` (what the project's
    ``rft_core.workers.sync`` constructs for backend ``nccl``); ``StandInNCCL.made`` emptied."""
    StandInNCCL.made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInNCCL, raising=False)
    yield StandInNCCL
