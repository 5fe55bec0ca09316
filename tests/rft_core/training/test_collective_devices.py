"""DeepSpeed on NCCL (issue 18): the metrics all-reduce builds its tensor on the device of the
process group's backend (NCCL accepts only CUDA tensors, gloo CPU ones), and on CUDA each rank
makes its own GPU (``LOCAL_RANK``) the current device before the process group starts. No GPU
here: a fake process group and a fake CUDA stand in."""
from __future__ import annotations

import pytest
import torch

from rft_core.training import zero as zero_module  # where DeepSpeedStrategy and its helpers live
from rft_core.training.strategy import DeepSpeedStrategy, collective_device


def test_collective_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("mpi") == torch.device("cpu")


class _FakeGroup:
    """torch.distributed's surface used by ``all_reduce_sum``: a world of 2 ranks whose other
    rank holds the same values, so the sum doubles them."""

    class ReduceOp:
        SUM = "sum"

    def __init__(self, backend: str):
        self.backend, self.seen = backend, []

    def get_backend(self):
        return self.backend

    def all_reduce(self, t, op):
        assert op == "sum"
        self.seen.append((t.device, t.dtype))
        t.mul_(2)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_all_reduce_sum_puts_its_tensor_on_the_backends_device(backend, monkeypatch):
    asked = []

    def device_for(name):  # the real choice for gloo; for nccl the CPU stands in for cuda:<rank>
        asked.append(name)
        return torch.device("cpu")

    monkeypatch.setattr(zero_module, "collective_device", device_for)
    ds = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # no deepspeed.initialize: only the collective
    ds._dist = _FakeGroup(backend)
    assert ds.all_reduce_sum([1.5, -2.0, 0.25]) == [3.0, -4.0, 0.5]
    assert asked == [backend] and ds._dist.seen == [(torch.device("cpu"), torch.float64)]


def test_nccl_ranks_select_their_gpu_before_the_process_group_starts(monkeypatch):
    import deepspeed
    import torch.distributed as dist

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend: calls.append(("init", dist_backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert zero_module.init_distributed() == (1, 2)
    assert calls == [("set_device", 1), ("init", "nccl")]
