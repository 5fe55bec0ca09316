"""The weight sync on the devices a GPU run has (issue 36, findings 1, 3 and 4), on a machine
without GPUs: DeepSpeed ZeRO-3's export and NCCL are the strict stand-ins of ``tests/standins``
(which say what they copy), the project's code is the real one.

- Finding 1: a ZeRO-3 policy gang exports its weights to the CPU (DeepSpeed's consolidated state
  dict), but sends over NCCL, which takes CUDA tensors only: the sender must pack onto the rank's
  GPU, whatever device the exported tensors are on.
- Finding 3: CUDA IPC under DeepSpeed: every rank takes part in the export, only rank 0 has the
  weights; the handles must be made on the rank's GPU, not on the exported tensors' CPU.
- Finding 4: on NCCL a stalled peer must end in ``WeightSyncError``, not in the watchdog tearing
  the process down; CUDA IPC handles name the GPU by UUID, opened on the receiver's own index
  of that GPU.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rft_core.models.loading import load_causal_lm
from rft_core.network import free_port
from rft_core.stages.sources import version_key
from rft_core.weightsync import collective
from rft_core.weightsync import collective as sync_module
from rft_core.weightsync import cuda_ipc
from rft_core.weightsync.base import Meet
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError
from rft_core.workers.policy import PolicyWorker
from tests.standins.deepspeed import zero3_strategy
from tests.standins.nccl import (StandInNCCL, WatchdogTeardown, check_gpu_device, check_gpu_single_tensor,
                                 host_memory_is_gpu, nccl_standin)

REF = "/policies/v1"


def _policy_worker(tiny_model, *, rank: int) -> PolicyWorker:
    """A policy worker holding a ZeRO-3 trainer (rank ``rank`` of 2) on ``cuda:<rank>``."""
    worker = PolicyWorker("pool", rank=rank, ranks=2)
    model = load_causal_lm(tiny_model)
    worker.held = SimpleNamespace(strategy=zero3_strategy(model, rank=rank, world_size=2, device=f"cuda:{rank}"))
    worker.version = version_key(REF)
    return worker


@pytest.fixture
def on_gpu(monkeypatch):
    """This thread's current CUDA device is 0 (``torch.cuda.current_device``), devices are told
    apart by UUID ``GPU-<index>``, and ``torch.cuda.synchronize`` does what torch's does with a
    device argument (refuses a non-CUDA device: torch/cuda/_utils.py ``_get_device_index``)."""
    local = threading.local()

    def synchronize(device=None):
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {torch.device(device)}")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(local, "index", int(index)))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return local


def test_zero3_gang_sync_over_nccl_sends_from_the_ranks_gpu(tiny_model, on_gpu, monkeypatch):
    """Finding 1: the ZeRO-3 export is on the CPU; the sender packs it onto cuda:0 bucket by bucket."""
    worker = _policy_worker(tiny_model, rank=0)
    sent = []

    def send_over_nccl(tensors, plan, *, backend, device, **kw):
        sent.append({"tensors": tensors, "backend": backend, "device": torch.device(device)})
        assert backend == "nccl"
        check_gpu_device(device)  # ProcessGroupNCCL's check of every bucket it is handed (packed on `device`)
        return SyncReport(plan.payload_bytes, 0.0, len(plan.bucket_sizes), "digest", backend)

    monkeypatch.setattr(collective, "send_weights", send_over_nccl)
    rep = worker.send_weights(REF, Meet(transport="nccl", dtype="bfloat16", backend="nccl", port=1))
    assert rep.digest == "digest"
    assert sent[0]["device"] == torch.device("cuda", 0)
    exported = sent[0]["tensors"]
    assert exported and all(t.device.type == "cpu" for t in exported.values())  # DeepSpeed's export, as it came
    assert worker.held.strategy.model.exports == 1


def test_send_weights_refuses_a_cpu_device_for_nccl_before_anyone_meets():
    """The project's own check, before a rendezvous that the receivers would wait out."""
    w = {"a": torch.ones(3)}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="NCCL moves CUDA tensors only"):
        sync_module.send_weights(w, SyncPlan.of(w), addr="127.0.0.1", port=free_port(), backend="nccl", device="cpu",
                                 timeout_s=30)
    with pytest.raises(ValueError, match="NCCL moves CUDA tensors only"):
        sync_module.receive_weights({"a": torch.zeros(3)}, SyncPlan.of(w), addr="127.0.0.1", port=free_port(),
                                    backend="nccl", timeout_s=30)
    assert time.perf_counter() - t0 < 5


def test_cuda_ipc_under_deepspeed_every_rank_exports_and_rank_0_packs_on_its_gpu(tiny_model, on_gpu, monkeypatch):
    """Finding 3: rank 1 takes part in the gather and returns nothing; rank 0 packs its CPU
    export onto cuda:0 (``torch.cuda.synchronize`` of a CPU device would fail)."""
    packed = []

    def export(tensors, plan, device):
        packed.append(torch.device(device))
        torch.cuda.synchronize(device)  # what export_cuda_ipc does after packing
        return [("handle", i) for i in range(len(plan.bucket_sizes))], ["buffer"]

    monkeypatch.setattr(cuda_ipc, "export_cuda_ipc", export)
    monkeypatch.setattr(cuda_ipc, "buffers_digest", lambda plan, buffers: "digest")
    meet = Meet(transport="cuda_ipc", dtype="bfloat16", backend="nccl")
    rank1 = _policy_worker(tiny_model, rank=1)
    assert rank1.send_weights(REF, meet) is None
    assert rank1.held.strategy.model.exports == 1  # it took part in the gather
    rank0 = _policy_worker(tiny_model, rank=0)
    got = rank0.send_weights(REF, meet)
    assert packed == [torch.device("cuda", 0)] and got.digest == "digest" and len(got.extra["handoff"]["handles"]) >= 1


# -- NCCL: the stand-in's refusals and a stalled peer ------------------------------------------


def test_nccl_standin_refuses_cpu_tensors_and_two_ranks_on_one_gpu(on_gpu, monkeypatch):
    with pytest.raises(ValueError, match="Tensors must be CUDA and dense"):
        check_gpu_single_tensor(torch.ones(2))
    with nccl_standin(monkeypatch):
        port = free_port()

        def rank(r):
            pg = sync_module._process_group("nccl", "127.0.0.1", port, r, 5.0, 2)
            with host_memory_is_gpu():
                sync_module._broadcast(pg, torch.ones(2), "the plan check", 5.0)

        with ThreadPoolExecutor(2) as ex:  # both ranks on GPU 0 (this fixture's current device in every thread)
            futures = [ex.submit(rank, r) for r in range(2)]
            for f in futures:
                with pytest.raises(Exception, match="Duplicate GPU detected"):
                    f.result(timeout=30)


def test_nccl_stalled_peer_raises_weight_sync_error_instead_of_tearing_the_process_down(on_gpu, monkeypatch):
    """Finding 4: ``_process_group`` builds its NCCL group with blocking wait (its own group
    only: the environment is left as it was), so a bucket whose receiver stalls raises
    ``WeightSyncError`` within the timeout; without it the watchdog takes the process down."""
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    port, stalled = free_port(), threading.Event()

    def sender():
        torch.cuda.set_device(0)
        pg = sync_module._process_group("nccl", "127.0.0.1", port, 0, 1.0, 2)
        sync_module._broadcast(pg, torch.ones(4), "the plan check", 1.0)
        try:
            sync_module._broadcast(pg, torch.ones(8), "bucket 1/3", 1.0)
        finally:
            stalled.set()

    def receiver():
        torch.cuda.set_device(1)
        pg = sync_module._process_group("nccl", "127.0.0.1", port, 1, 1.0, 2)
        sync_module._broadcast(pg, torch.zeros(4), "the plan check", 1.0)
        stalled.wait(30)  # never joins bucket 1

    with nccl_standin(monkeypatch), host_memory_is_gpu(), ThreadPoolExecutor(2) as ex:
        t0 = time.perf_counter()
        got, send = ex.submit(receiver), ex.submit(sender)
        try:
            with pytest.raises(WeightSyncError, match="during bucket 1/3"):
                send.result(timeout=30)
        except WatchdogTeardown as exc:  # the process would be gone: the finding
            pytest.fail(f"NCCL's watchdog tore the process down instead of a WeightSyncError: {exc}")
        got.result(timeout=30)
    assert time.perf_counter() - t0 < 15
    assert [pg.blocking_wait for pg in StandInNCCL.made] == [True, True]
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


# -- CUDA IPC: the GPU named by UUID ---------------------------------------------------------------


def test_cuda_ipc_handle_opens_on_the_receivers_index_of_the_senders_gpu(on_gpu, monkeypatch):
    """Finding 4: the sender's process numbers its GPUs [A, B], the receiver's [B, A]; torch's
    handle carries the sender's index (0), which is B in the receiver. The handle names the GPU
    by UUID and the receiver opens it on its own index of that GPU (1), as SGLang does
    (sglang/srt/utils/patch_torch.py, 0.5.23)."""
    from torch.multiprocessing import reductions

    physical = {"sender": ["GPU-A", "GPU-B"], "receiver": ["GPU-B", "GPU-A"]}  # CUDA_VISIBLE_DEVICES orders
    side = {"now": "sender"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=physical[side["now"]][i]))
    memory = {}
    opened = []

    def rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, *rest):
        """torch's rebuild opens the handle on ``device`` (an index of this process)."""
        opened.append(device)
        assert isinstance(device, int), f"torch's rebuild_cuda_tensor takes a device index, got {device!r}"
        where, buf = memory[handle]
        if physical[side["now"]][device] != where:
            raise RuntimeError(f"CUDA IPC handle of {where} opened on device {device} ({physical[side['now']][device]})")
        return buf

    def reduce_tensor(t):
        """torch/multiprocessing/reductions.py ``reduce_tensor`` of a CUDA tensor: 15 arguments, the 7th the device index."""
        memory[id(t)] = (physical["sender"][0], t)
        return rebuild_cuda_tensor, (type(t), t.shape, t.stride(), 0, None, t.dtype, 0, id(t), t.numel(), 0, False,
                                     None, 0, None, False)

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    src = {"a.weight": torch.randn(5, 3), "b.weight": torch.randn(7)}
    plan = SyncPlan.of(src, bucket_mb=0.0001)
    buffers = [sync_module.pack_bucket(plan, src, i, torch.device("cpu")) for i in range(len(plan.bucket_sizes))]
    handles = [cuda_ipc.share_cuda_ipc(b) for b in buffers]
    assert all(args[6] == "GPU-A" for _, args in handles)
    side["now"] = "receiver"
    target = {k: torch.zeros_like(v) for k, v in src.items()}
    cuda_ipc.import_cuda_ipc(handles, target, plan)
    assert opened == [1] * len(handles) and all(torch.equal(target[k], src[k]) for k in src)
    physical["receiver"] = ["GPU-B", "GPU-C"]
    with pytest.raises(WeightSyncError, match="GPU-A"):
        cuda_ipc.import_cuda_ipc(handles, target, plan)


def test_a_deepspeed_lora_trainer_is_refused_by_name_for_an_adapter_or_a_merged_sync(tiny_model):
    """``resident_blockers`` refuses update.deepspeed with update.lora first; reached otherwise, an
    adapter sync and a merged sync from a ZeRO trainer of a peft model are refused by name
    (DeepSpeed's bf16 mode casts the adapters to bfloat16), and a ZeRO trainer of a plain model
    still merges nothing (``merged_tensors`` is its gathered weights)."""
    from rft_core.models.lora import apply_lora
    from rft_core.weightsync.trained import merged_tensors, trained_adapters

    lora = apply_lora(load_causal_lm(tiny_model, trainable=True), rank=2, alpha=4.0, dropout=0.0,
                      target_modules="all-linear", base_path=tiny_model, seed=0)
    strategy = zero3_strategy(lora, rank=0, world_size=1, device="cpu")
    with pytest.raises(WeightSyncError, match="an adapter sync from a DeepSpeed LoRA trainer is not implemented"):
        trained_adapters(strategy)
    with pytest.raises(WeightSyncError, match="a merged sync from a DeepSpeed LoRA trainer is not implemented"):
        merged_tensors(strategy)
    plain = load_causal_lm(tiny_model)
    sent = merged_tensors(zero3_strategy(plain, rank=0, world_size=1, device="cpu"))
    assert sent.keys() == {k for k in plain.state_dict() if k != "lm_head.weight"}
