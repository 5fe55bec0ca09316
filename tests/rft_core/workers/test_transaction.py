"""The weight-sync transaction in one place (issue 46): ``rft_core.weightsync.session.pull`` over
the shared-memory transport (bit-exact landing, a byte flipped in transit caught, a sender that
never hands over, a segment that vanished, another layout, the choice of transport), over the
in-process transport with the real policy worker, and the one weight digest (the digests
already recorded in manifests still verify)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rft_core.stages.lineage import trained_digest
from rft_core.weightsync import shm
from rft_core.weightsync.base import Meet
from rft_core.weightsync.choose import choose_transport
from rft_core.weightsync.digest import Digest, digest_like, method_of, weights_digest
from rft_core.weightsync.landing import IntoTensors
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError
from rft_core.weightsync.session import Offer, pull
from rft_core.weightsync.shm import Shm, host_id, segment_layout

BUCKET_MB = 0.01  # several buckets


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 17, generator=g), "layers.0.norm.weight": torch.randn(17, generator=g),
            "layers.0.proj.weight": torch.randn(17, 33, generator=g), "rope.positions": torch.arange(5),
            "odd.bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g)}  # buckets of odd sizes


def _zeros(src: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
            for k, v in src.items()}


class ShmLeg:
    """A sender in another thread of this process that the session sees on another process of
    this host (``local`` False): its own ``Shm`` transport sends ``tensors``. ``corrupt``: flip
    one byte of the segment after the send digested it (in transit); ``hang``: the send never
    answers (its wait gives up after ``timeout_s``, as ``Gang.wait`` does)."""

    local = False

    def __init__(self, tensors, *, corrupt: bool = False, hang: bool = False, timeout_s: float = 10.0):
        self.tensors, self.corrupt, self.hang, self.timeout_s = tensors, corrupt, hang, timeout_s
        self.link, self.pool, self.calls = Shm(timeout_s=timeout_s), ThreadPoolExecutor(1), []

    def offer(self, dtype):
        return Offer(backend="gloo", device="cpu", host=host_id(), addr="127.0.0.1", port=0,
                     shm_free=self.link.capacity())

    def _send(self, meet: Meet) -> SyncReport:
        if self.hang:
            threading.Event().wait(self.timeout_s * 3)
        rep = self.link.send(self.tensors, SyncPlan.of(self.tensors, dtype=meet.dtype, bucket_mb=BUCKET_MB), meet)
        if self.corrupt:
            with open(rep.extra["handoff"]["path"], "r+b") as f:
                f.seek(rep.extra["handoff"]["starts"][1] + 5)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x10]))
        return rep

    def start(self, meet):
        self.calls.append(("start", meet.transport))
        return self.pool.submit(self._send, meet)

    def wait(self, started):
        return started.result(timeout=self.timeout_s)  # TimeoutError past it

    def cancel(self, started):
        self.calls.append(("cancel",))

    def finish(self, meet):
        self.calls.append(("finish",))
        self.link.finalize(meet)


def _pull(leg, target, dtype="float32", timeout_s=10.0):
    invalid = []
    got = pull(leg, IntoTensors(target, dtype, on_invalid=lambda: invalid.append(1)), version="v1",
               timeout_s=timeout_s, bucket_mb=BUCKET_MB)
    return got, invalid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shm_lands_every_byte_bit_exact_and_reuses_its_segment(dtype):
    src = _weights(0)
    target = _zeros(src, getattr(torch, dtype))
    leg = ShmLeg(src)
    try:
        got, invalid = _pull(leg, target, dtype)
        assert got.extra["transport"] == "shm" and got.backend == "shm" and got.buckets >= 2
        assert all(torch.equal(src[k].to(target[k].dtype), target[k]) for k in src)
        assert got.digest == weights_digest(target, "xxh3") and method_of(got.digest) == "xxh3"
        assert invalid == [1] and leg.calls == [("start", "shm"), ("finish",)]
        path = leg.link._segment.path
        assert Path(path).exists() and Path(path).name.startswith(f"{shm.PREFIX}{os.getpid()}-")
        leg.tensors = _weights(1)
        _pull(leg, target, dtype)  # the next sync reuses the segment and the receiver's mapping
        assert leg.link._segment.path == path and shm._MAPPED[path][0][0] == leg.link._segment.inode
        assert all(torch.equal(leg.tensors[k].to(target[k].dtype), target[k]) for k in src)
    finally:
        leg.link.close()
    assert not Path(path).exists()


def test_a_byte_flipped_in_transit_fails_the_sync_and_the_copy_holds_no_version():
    src = _weights(0)
    target = _zeros(src)
    leg = ShmLeg(src, corrupt=True)
    try:
        with pytest.raises(WeightSyncError, match=r"weight sync of v1: the landed weights' digest .*-xxh3:.* differs "
                                                  r"from the sent .*-xxh3:"):
            _pull(leg, target)
        assert leg.calls[-1] == ("finish",)  # the sender freed what it kept
        leg.corrupt = False
        got, _ = _pull(leg, target)  # the next sync lands
        assert all(torch.equal(src[k], target[k]) for k in src)
    finally:
        leg.link.close()


def test_invalid_until_verified():
    """The landing's ``on_invalid`` runs before a byte moves and again when the sync fails."""
    src, seen = _weights(0), []
    leg = ShmLeg(src, corrupt=True)
    try:
        with pytest.raises(WeightSyncError):
            pull(leg, IntoTensors(_zeros(src), "float32", on_invalid=lambda: seen.append(len(leg.calls))),
                 version="v1", timeout_s=10.0, bucket_mb=BUCKET_MB)
    finally:
        leg.link.close()
    assert seen == [0, 2]  # before the send started; after it failed (start, finish)


def test_a_sender_that_never_hands_over_fails_within_its_limit_and_is_ended():
    src = _weights(0)
    target = _zeros(src)
    leg = ShmLeg(src, hang=True, timeout_s=1.0)
    t0 = time.perf_counter()
    try:
        with pytest.raises(WeightSyncError, match="did not hand its weights over within its limit and was ended"):
            _pull(leg, target, timeout_s=1.0)
    finally:
        leg.link.close()
    assert time.perf_counter() - t0 < 5
    assert ("cancel",) in leg.calls and all(float(t.abs().sum()) == 0 for t in target.values())


def test_a_vanished_segment_or_another_layout_fails_before_a_byte_lands():
    src = _weights(0)
    link = Shm()
    try:
        rep = link.send(src, SyncPlan.of(src, bucket_mb=BUCKET_MB), Meet(transport="shm", dtype="float32"))
        other = dict(src, **{"layers.0.norm.weight": torch.zeros(18)})
        target = _zeros(other)
        with pytest.raises(WeightSyncError, match="another layout"):
            Shm().receive(SyncPlan.of(target, bucket_mb=BUCKET_MB),
                          Meet(transport="shm", dtype="float32", handoff=rep.extra["handoff"]), IntoTensors(target))
        Path(rep.extra["handoff"]["path"]).unlink()  # e.g. removed by a sweep
        target = _zeros(src)
        with pytest.raises(WeightSyncError, match="is not here"):
            Shm().receive(SyncPlan.of(target, bucket_mb=BUCKET_MB),
                          Meet(transport="shm", dtype="float32", handoff=rep.extra["handoff"]), IntoTensors(target))
        assert all(float(t.abs().sum()) == 0 for t in target.values())
    finally:
        link.close()


def test_shm_is_chosen_for_two_processes_on_one_hosts_cpu_with_room():
    cpu, nbytes = torch.device("cpu"), 10_000
    pick = lambda **kw: choose_transport(**{"backend": "gloo", "sender_device": "cpu", "receiver_device": cpu,  # noqa: E731
                                            "sender_host": host_id(), "shm_free": nbytes, "nbytes": nbytes, **kw})
    assert pick() == "shm"
    assert pick(shm_free=nbytes - 1) == "gloo"  # no room in the sender's /dev/shm
    assert pick(sender_host="another-host|boot|1:2") == "gloo"
    assert pick(same_process=True) == "local"
    assert pick(engine="vllm") == "vllm"
    assert pick(backend="nccl", sender_device="GPU-0") == "nccl"  # weights on a GPU: not through the host


def test_a_dead_senders_segment_is_swept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = shm.SHM_DIR / f"{shm.PREFIX}{pid}-stale"
    mine = shm.SHM_DIR / f"{shm.PREFIX}{os.getpid()}-mine"
    stale.write_bytes(b"x")
    mine.write_bytes(b"x")
    try:
        assert stale.name in shm.sweep() and not stale.exists() and mine.exists()
    finally:
        stale.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def test_segment_layout_aligns_every_bucket():
    plan = SyncPlan.of(_weights(0), bucket_mb=BUCKET_MB)
    starts, size = segment_layout(plan)
    assert starts[0] == 0 and all(s % 64 == 0 for s in starts)
    assert size == starts[-1] + plan.bucket_sizes[-1] and any(b % 64 for b in plan.bucket_sizes)


def test_the_policy_workers_close_removes_its_segment():
    """A stopped policy worker leaves no segment in /dev/shm: ``stop_workers`` calls its
    ``close`` before ``ray.kill`` ends the actor (no exit handler of its runs then)."""
    from rft_core.workers.policy import PolicyWorker

    worker, w = PolicyWorker("pool"), _weights(0)
    sent = worker._link("shm").send(w, SyncPlan.of(w, bucket_mb=BUCKET_MB), Meet(transport="shm", dtype="float32"))
    path = Path(sent.extra["handoff"]["path"])
    assert path.exists()
    worker.close()
    assert not path.exists() and worker._links == {}


def test_the_in_process_policy_worker_sends_through_the_same_transaction(tiny_model):
    """The real policy worker's send leg (``PolicySendLeg``) in this process: the ``local``
    transport, verified; a version it does not hold fails the sync (its send raised)."""
    from rft_core.models.loading import load_causal_lm
    from rft_core.weightsync.plan import state_tensors
    from rft_core.workers.base import Gang
    from rft_core.workers.policy import PolicySendLeg, PolicyWorker

    worker = PolicyWorker("pool")
    worker.held = SimpleNamespace(strategy=SimpleNamespace(model=load_causal_lm(tiny_model)))
    worker.trained("/policies/v2")
    target = {k: torch.zeros_like(v) for k, v in state_tensors(load_causal_lm(tiny_model)).items()}
    gang = Gang(PolicyWorker, [worker])
    got, invalid = _pull(PolicySendLeg(gang, "/policies/v2"), target)
    sent = state_tensors(worker.held.strategy.model)
    assert got.extra["transport"] == "local" and invalid == [1]
    assert all(torch.equal(sent[k], target[k]) for k in sent)
    leg = PolicySendLeg(gang, "/policies/v2")
    offer = leg.offer

    def offer_then_train(dtype):
        answer = offer(dtype)
        worker.trained("/policies/v3")  # an update ran between the offer and the send
        return answer

    leg.offer = offer_then_train
    with pytest.raises(WeightSyncError, match="the policy worker failed: the policy worker holds path:/policies/v3, "
                                              "not path:/policies/v2"):
        _pull(leg, target)


def test_a_lora_policy_below_float32_syncs_its_adapters_and_a_copy_that_would_merge_is_refused(tiny_model):
    """The real policy worker holding a bfloat16 LoRA policy (moved adapters): a landing of the
    receiver's adapters (``IntoTensors(adapters=True)``, what the rollout worker builds with
    ``lora``) gets the trainer's float32 adapters through the session (``Meet.adapters`` ->
    ``send_weights`` -> ``adapter_tensors``), and the copy then computes the trainer's logits bit
    for bit; the ends disagreeing is refused before anything moves or the copy is invalidated
    (``check_adapters``): a bfloat16 copy of every weight (no ``lora`` given), adapters asked of a
    full-weight policy, and a policy training a module outside its LoRA layers."""
    from peft import LoraConfig, get_peft_model

    from rft_core.models.loading import load_causal_lm
    from rft_core.models.lora import apply_lora
    from rft_core.weightsync.plan import state_tensors
    from rft_core.weightsync.trained import adapter_tensors
    from rft_core.workers.base import Gang
    from rft_core.workers.policy import PolicySendLeg, PolicyWorker

    def lora(seed):
        return apply_lora(load_causal_lm(tiny_model, dtype="bfloat16"), rank=4, alpha=8, dropout=0.0,
                          target_modules="all-linear", base_path=tiny_model, seed=seed).eval()

    def worker_holding(model):
        worker = PolicyWorker("pool")
        worker.held = SimpleNamespace(strategy=SimpleNamespace(model=model))
        worker.trained("/policies/v2")
        return PolicySendLeg(Gang(PolicyWorker, [worker]), "/policies/v2")

    trainer, copy = lora(0), lora(1)
    with torch.no_grad():
        for t in adapter_tensors(trainer).values():
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())) * 0.05)
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    logits = lambda m: m(input_ids=ids).logits.detach()  # noqa: E731
    assert not torch.equal(logits(trainer), logits(copy))
    invalid = []
    got = pull(worker_holding(trainer), IntoTensors(adapter_tensors(copy), on_invalid=lambda: invalid.append(1),
                                                     adapters=True), version="v2", timeout_s=10, bucket_mb=BUCKET_MB)
    assert got.bytes == sum(t.numel() * 4 for t in adapter_tensors(trainer).values()) and invalid == [1]
    assert torch.equal(logits(trainer), logits(copy))

    bf16_copy, base = state_tensors(load_causal_lm(tiny_model, dtype="bfloat16")), load_causal_lm(tiny_model, dtype="bfloat16")
    refused = [(trainer, lambda seen: IntoTensors(bf16_copy, "bfloat16", on_invalid=seen), "was not given the run's update.lora"),
               (base, lambda seen: IntoTensors(adapter_tensors(copy), on_invalid=seen, adapters=True),
                "holds a policy without them")]
    for model, landing, message in refused:
        seen = []
        with pytest.raises(WeightSyncError, match=message):
            pull(worker_holding(model), landing(lambda: seen.append(1)), version="v2", timeout_s=10, bucket_mb=BUCKET_MB)
        assert seen == []  # refused at the offer: the landing was never invalidated, nothing moved
    pull(worker_holding(trainer), IntoTensors(state_tensors(load_causal_lm(tiny_model)), "float32"), version="v2",
         timeout_s=10, bucket_mb=BUCKET_MB)  # float32: the merged weights, as stage mode's passes merge
    saving = get_peft_model(load_causal_lm(tiny_model, dtype="bfloat16"),
                            LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(WeightSyncError, match=r"the policy worker failed: the policy trains 1 parameter\(s\) outside its "
                                              "LoRA layers"):  # refused at its send: adapter_tensors
        pull(worker_holding(saving), IntoTensors(adapter_tensors(copy), adapters=True), version="v2", timeout_s=10,
             bucket_mb=BUCKET_MB)


# -- the one weight digest -----------------------------------------------------------------------


def _legacy_sha256(tensors) -> str:
    """What CPU runs recorded before issue 46 (``rft_core.weightsync.plan.weights_digest`` then)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_every_recorded_digest_format_still_verifies_and_sees_a_flipped_bit():
    w = _weights(0)
    flipped = dict(w, **{"layers.0.norm.weight": w["layers.0.norm.weight"].clone()})
    flipped["layers.0.norm.weight"].view(torch.int32)[3] ^= 1
    legacy = _legacy_sha256(w)  # a manifest of a run before issue 46: 64 hex
    device = weights_digest(w, "device")  # a GPU run's: <16 hex>-<16 hex>
    new = weights_digest(w)  # a CPU run's from now on
    assert [method_of(d) for d in (legacy, device, new)] == ["sha256", "device", "xxh3"]
    assert len(legacy) == 64 and len(device) == 33 and new.startswith(device[:17]) and "-xxh3:" in new
    for recorded in (legacy, device, new):
        assert digest_like(w, recorded) == recorded  # recovery's check of a rebuilt trainer
        assert digest_like(flipped, recorded) != recorded
    model = SimpleNamespace(state_dict=lambda keep_vars=False: w)  # a single-process trainer's model
    strategy = SimpleNamespace(model=model)
    assert trained_digest(strategy) == new and trained_digest(strategy, like=legacy) == legacy
    assert trained_digest(strategy, like=device) == device
    with pytest.raises(ValueError, match="not a weights digest"):
        method_of("sha256:abc")


def test_the_streamed_digest_equals_the_digest_of_the_landed_tensors():
    """``Digest.copy_into`` (pieces copied and hashed on threads) gives what ``weights_digest``
    of the result gives, across piece boundaries (a tensor of several 8 MiB pieces)."""
    from rft_core.weightsync import digest as digest_module

    big = {"a.weight": torch.randn(5 * digest_module.PIECE_BYTES // 4 // 2 + 7), "b": torch.arange(3)}
    out = {k: torch.empty_like(v) for k, v in big.items()}
    d = Digest([(k, big[k].dtype, tuple(big[k].shape)) for k in sorted(big)], "xxh3")
    for k in sorted(big):
        d.copy_into(k, out[k], big[k])
    assert d.hexdigest() == weights_digest(big, "xxh3") == weights_digest(out, "xxh3")
    assert all(torch.equal(big[k], out[k]) for k in big)
