"""Weight sync (rft_core.weightsync): the plan, the two-rank gloo transaction (exact bytes,
dtype casts, digests), and its failures (layout mismatch, a peer that never comes)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rft_core.network import free_port
from rft_core.weightsync.collective import receive_weights, send_weights
from rft_core.weightsync.digest import weights_digest
from rft_core.weightsync.plan import SyncPlan, WeightSyncError, state_tensors


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 17, generator=g), "layers.0.norm.weight": torch.randn(17, generator=g),
            "layers.0.proj.weight": torch.randn(17, 33, generator=g), "rope.positions": torch.arange(5)}


def test_plan_aligns_every_tensor_and_respects_the_bucket_limit():
    w = _weights()
    plan = SyncPlan.of(w, bucket_mb=16 * 1024 / 2**20)  # 16 KiB buckets: the 20 KB embedding gets one of its own
    assert [e.name for e in plan.entries] == sorted(w)
    assert all(e.offset % 64 == 0 for e in plan.entries)
    assert {e.name: e.nbytes for e in plan.entries} == {n: t.numel() * t.element_size() for n, t in w.items()}
    for i, size in enumerate(plan.bucket_sizes):
        entries = plan.bucket(i)
        assert size == entries[-1].offset + entries[-1].nbytes
        assert size <= 16 * 1024 or len(entries) == 1  # only a tensor larger than a bucket exceeds it
    assert [[e.name for e in plan.bucket(i)] for i in range(2)] == [
        ["embed.weight"], ["layers.0.norm.weight", "layers.0.proj.weight", "rope.positions"]]  # name order
    assert plan.total_bytes == sum(plan.bucket_sizes) == 20400 + 2432 + 40  # proj ends at 64 + 17*33*4 = 2308 -> 2368
    assert plan.payload_bytes == sum(t.numel() * t.element_size() for t in w.values())


def test_plan_casts_floating_tensors_only_and_fingerprints_the_layout():
    w = _weights()
    plan = SyncPlan.of(w, dtype="bfloat16")
    dtypes = {e.name: e.dtype for e in plan.entries}
    assert dtypes["embed.weight"] == "bfloat16" and dtypes["rope.positions"] == "int64"
    other = dict(w, **{"layers.0.norm.weight": torch.zeros(18)})
    assert SyncPlan.of(other).fingerprint() != SyncPlan.of(w).fingerprint()
    assert plan.fingerprint() != SyncPlan.of(w).fingerprint()  # another dtype, another layout
    assert SyncPlan.of(_weights(1)).fingerprint() == SyncPlan.of(w).fingerprint()  # values do not count


def test_digest_changes_with_one_bit():
    w = _weights()
    d = weights_digest(w)
    assert weights_digest({k: v.clone() for k, v in w.items()}) == d
    flipped = w["layers.0.norm.weight"].clone()
    flipped.view(torch.int32)[3] ^= 1
    assert weights_digest(dict(w, **{"layers.0.norm.weight": flipped})) != d


def _sync(src: dict, dst: dict, *, dtype=None, bucket_mb=0.01, timeout_s=30.0):
    """Send ``src`` into ``dst`` over a gloo pair (receiver in a thread): (sender report, receiver report)."""
    port = free_port()
    plan_s, plan_r = SyncPlan.of(src, dtype=dtype, bucket_mb=bucket_mb), SyncPlan.of(dst, bucket_mb=bucket_mb)
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(receive_weights, dst, plan_r, addr="127.0.0.1", port=port, timeout_s=timeout_s)
        sent = send_weights(src, plan_s, addr="127.0.0.1", port=port, timeout_s=timeout_s)
        return sent, got.result(timeout=timeout_s + 5)


def test_gloo_sync_lands_every_byte_in_several_buckets():
    src, dst = _weights(0), {k: torch.zeros_like(v) for k, v in _weights(0).items()}
    sent, got = _sync(src, dst)
    assert sent.buckets == got.buckets > 1
    assert all(torch.equal(src[k], dst[k]) for k in src)
    assert sent.digest == got.digest == weights_digest(src, "xxh3")  # gloo verifies with XXH3-128 on the host
    assert got.bytes == sum(t.numel() * t.element_size() for t in src.values())


def test_gloo_sync_into_bfloat16_equals_the_cast():
    src = _weights(0)
    dst = {k: torch.zeros_like(v, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in src.items()}
    sent, got = _sync(src, dst, dtype="bfloat16")
    assert all(torch.equal(src[k].to(dst[k].dtype), dst[k]) for k in src)
    assert sent.digest == got.digest


def test_layout_mismatch_fails_both_sides_before_any_tensor_is_written():
    src = _weights(0)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dst["layers.0.norm.weight"] = torch.zeros(18)
    port = free_port()
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(receive_weights, dst, SyncPlan.of(dst), addr="127.0.0.1", port=port, timeout_s=5)
        with pytest.raises(WeightSyncError):
            send_weights(src, SyncPlan.of(src), addr="127.0.0.1", port=port, timeout_s=5)
        with pytest.raises(WeightSyncError, match="another layout"):
            got.result(timeout=30)
    assert all(float(t.abs().sum()) == 0 for t in dst.values())


def test_an_adapter_sync_lands_the_trainers_lora_adapters_on_the_receivers_own_base(tiny_model):
    """``adapter_tensors`` over gloo (``Meet.adapters``, what the rollout worker asks below
    float32): the trainer's float32 adapters land in place in a bfloat16 copy that holds the same
    base and other adapters, which then computes the trainer's logits bit for bit; only the
    adapters' bytes moved. A model without adapters is refused by name."""
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.lora import apply_lora
    from rft_core.weightsync.trained import adapter_tensors

    def lora(seed):
        model = apply_lora(load_causal_lm(tiny_model, dtype="bfloat16"), rank=4, alpha=8, dropout=0.0,
                           target_modules="all-linear", base_path=tiny_model, seed=seed)
        return model.eval()

    trainer, copy = lora(0), lora(1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # moved adapters: lora_B is 0 on a fresh adapter
        for name, t in adapter_tensors(trainer).items():
            t.copy_(torch.randn(t.shape, generator=g) * (0.05 if "lora_B" in name else 1.0))
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 7, 3]])

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits

    assert not torch.equal(logits(trainer), logits(copy))
    src, dst = adapter_tensors(trainer), adapter_tensors(copy)
    assert sorted(src) == sorted(dst) and {t.dtype for t in src.values()} == {torch.float32}
    assert sorted(src) == sorted(n for n, p in trainer.named_parameters() if p.requires_grad)  # peft's trainables
    sent, got = _sync(src, dst, dtype="float32")
    assert sent.digest == got.digest and got.bytes == sum(t.numel() * 4 for t in src.values())
    assert got.bytes * 20 < sum(t.numel() * t.element_size() for t in state_tensors(trainer).values())
    assert torch.equal(logits(trainer), logits(copy))
    with pytest.raises(WeightSyncError, match="LlamaForCausalLM, which holds no LoRA adapter"):
        adapter_tensors(load_causal_lm(tiny_model))


def test_sender_without_receiver_fails_within_the_timeout():
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="rendezvous"):
        send_weights(_weights(), SyncPlan.of(_weights()), addr="127.0.0.1", port=free_port(), timeout_s=1.5)
    assert time.perf_counter() - t0 < 15


def test_state_tensors_lists_a_tied_weight_once(tiny_model):
    from rft_core.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model)
    t = state_tensors(model)
    assert set(model.state_dict()) - set(t) == {"lm_head.weight"}  # tied to the embedding: moved once
    assert "model.embed_tokens.weight" in t
    assert len({v.data_ptr() for v in t.values()}) == len(t)


def test_a_sync_in_a_process_without_ray_or_peft_imports_neither(tiny_model):
    """The first sync of an in-process driver imported Ray only to ask whether it was initialised
    (1.0 s) and peft only to ask whether the model was a LoRA one (0.4 s): 1.4 s inside step 2's
    ``weight_sync`` of ``make bench-gpu`` on the CPU. Neither can be so in a process that never
    imported them; asked in a fresh interpreter, the answers are the same and neither is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rft_core.models.loading import load_causal_lm\n"
        "from rft_core.weightsync.collective import host_address\n"
        "from rft_core.weightsync.plan import state_tensors\n"
        "from rft_core.weightsync.trained import inference_tensors\n"
        f"model = load_causal_lm({str(tiny_model)!r})\n"
        "t, s = inference_tensors(model), state_tensors(model)\n"
        "assert list(t) == list(s) and all(t[k].data_ptr() == s[k].data_ptr() for k in t), list(t)\n"
        "print(host_address(), 'ray' in sys.modules, 'peft' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["127.0.0.1", "False", "False"]


class _Sender:
    """A started send as the session sees it (``rft_core.weightsync.session.SendLeg``): ``wait``
    answers ``outcome`` (a report, or an exception to raise), ``cancel`` is recorded."""

    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    def wait(self, started):
        self.calls.append(("wait", started))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self, started):
        self.calls.append(("cancel", started))


def test_a_failed_receiver_awaits_its_sender_and_ends_one_that_outlived_its_limit():
    """Issue 45, finding 2: after a receive fails, the sender is awaited (its own limit bounds the
    wait, ``Gang.wait``'s ``sync_timeout_s``) so that it is not left busy; one that fails too is
    left as it is (the receiver's error is the one raised), one whose wait times out is still
    running past every limit of the transaction (stuck in NCCL's communicator setup, which no
    timeout covers): it is cancelled (the policy gang's ``cancel`` ends its ranks)."""
    from rft_core.weightsync.session import settle

    done = _Sender({"digest": "d"})
    assert "finished" in settle(done, "s1") and done.calls == [("wait", "s1")]
    failed = _Sender(WeightSyncError("rendezvous failed"))
    assert "rendezvous failed" in settle(failed, "s2") and failed.calls == [("wait", "s2")]
    stuck = _Sender(TimeoutError("1 of 1 ranks did not answer within 2 s"))
    assert "ended" in settle(stuck, "s3") and stuck.calls == [("wait", "s3"), ("cancel", "s3")]
