"""In-memory weight sync into the GPU engines (rft_core.workers.engine_sync, the vLLM worker
extension, SGLang's update_weights_from_tensor) and the device-side checksum (sync_checksum).

No GPU here: vLLM's workers are stand-ins running the real ``WeightReloadExtension`` code over a
tiny HF model with vLLM's ``load_weights`` contract, called from a fake ``LLM.collective_rpc`` in
threads (tensor parallel 2 = two receivers in one group); SGLang's engine is a stand-in whose
``update_weights_from_tensor`` writes into a tiny model. The gloo process groups, the plans, the
checksums and the engines' bookkeeping are the real ones; the sender runs ``send_weights`` in a
thread."""
from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine
from rft_core.engines.vllm import VLLMEngine, WeightReloadExtension
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.workers.checksum import CHUNK, M31, meta_digest, multipliers, name_weight, row_weights, word_sums
from rft_core.workers.engine_sync import pull_into_engine
from rft_core.workers import sync as sync_module
from rft_core.workers.sync import (SyncPlan, WeightSyncError, buffers_checksum, free_port, receive_weights, send_weights,
                                   state_tensors, sync_checksum)
from tests.rft_core.engines.fakes import HFBackedLLM, HFBackedSGLang, SamplingParams

BUCKET_MB = 0.05  # several buckets for the tiny model (its embedding gets one of its own)
REF = "/policies/v1"  # a policy version (its key: "path:/policies/v1")

# -- sync_checksum ---------------------------------------------------------------------------


def _ref_sums(t: torch.Tensor) -> list[int]:
    """The module docstring's formula with Python ints, word by word."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    raw += [0] * (len(raw) % 2)
    words = [int.from_bytes(bytes(raw[i:i + 2]), "little", signed=True) for i in range(0, len(raw), 2)]
    out = []
    for s in (0, 1):
        total = 0
        for r in range(0, len(words), CHUNK):
            row = sum(w * multipliers(j, s) for j, w in enumerate(words[r:r + CHUNK])) % 2**31
            total = (total + row * row_weights(r // CHUNK, s)) % 2**31
        out.append(total)
    return out


def test_checksum_hand_checked_small_cases():
    b0, b1 = multipliers(0, 0), multipliers(1, 0)
    assert all(m % 2 == 1 and 0 < m < 2**15 for m in (b0, b1, multipliers(5, 1)))
    c0 = row_weights(0, 0)
    assert c0 % 2 == 1 and c0 < 2**31
    assert word_sums(torch.tensor([1], dtype=torch.int16)).tolist()[0] == b0 * c0 % 2**31
    assert word_sums(torch.tensor([1, 1], dtype=torch.int16)).tolist()[0] == (b0 + b1) * c0 % 2**31
    assert word_sums(torch.tensor([-1], dtype=torch.int16)).tolist()[0] == -b0 * c0 % 2**31  # signed words
    # 1.0f = 0x3F800000: little-endian words 0x0000, 0x3F80
    assert word_sums(torch.tensor([1.0])).tolist()[0] == 0x3F80 * b1 * c0 % 2**31
    # one byte: padded with a zero byte to one word (0x07 | 0x00 << 8)
    assert word_sums(torch.tensor([7], dtype=torch.uint8)).tolist()[0] == 7 * b0 * c0 % 2**31
    t = torch.tensor([3, -2], dtype=torch.int16)
    s = word_sums(t).tolist()
    layout_hex = __import__("hashlib").sha256(b"w|int16|(2,)\n").hexdigest()[:16]
    assert sync_checksum({"w": t}) == f"{layout_hex}-{s[0] * name_weight('w') & M31:08x}{s[1] * name_weight('w') & M31:08x}"
    # pinned: the same string on every machine and release (sender and receiver may differ)
    assert sync_checksum({"w": t}) == "c3315bc3c39e06b4-26ce512b7d9b417f"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_checksum_equals_the_python_reference_and_sees_every_flipped_bit(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, generator=g) * 1000).to(dtype)
    assert word_sums(t).tolist() == _ref_sums(t)
    base = sync_checksum({"a": t})
    raw = t.view(torch.uint8).reshape(-1)
    for i in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[i] ^= 1 << bit
            assert sync_checksum({"a": flipped.view(dtype).reshape(t.shape)}) != base, (i, bit)


def test_checksum_spans_rows_exactly_and_depends_on_position_name_dtype_and_shape():
    t = torch.randn(CHUNK // 2 * 3 + 5)  # 1.5 rows of words + a tail
    w = t.view(torch.int16).to(torch.int64)
    j = torch.arange(w.numel())
    ref = []
    for s in (0, 1):  # an int64 reference (products < 2**30, row sums < 2**52)
        rows = [(w[r:r + CHUNK] * multipliers(j[:min(CHUNK, w.numel() - r)], s)).sum().item() % 2**31
                for r in range(0, w.numel(), CHUNK)]
        ref.append(sum(x * row_weights(k, s) for k, x in enumerate(rows)) % 2**31)
    assert word_sums(t).tolist() == ref
    a = torch.arange(6, dtype=torch.float32)
    base = sync_checksum({"a": a})
    assert sync_checksum({"a": a[[1, 0, 2, 3, 4, 5]]}) != base  # two words swapped
    assert sync_checksum({"b": a}) != base
    assert sync_checksum({"a": a.reshape(2, 3)}) != base
    assert sync_checksum({"a": a.view(torch.int32)}) != base
    assert sync_checksum({"a": a, "b": a + 1}) != sync_checksum({"a": a + 1, "b": a})
    assert sync_checksum({"a": a.clone()}) == base and sync_checksum({"a": torch.zeros(0)}) != sync_checksum({})


# -- the plan and the n-rank transaction --------------------------------------------------------


def test_plan_json_round_trips_exactly():
    w = {"embed.weight": torch.randn(300, 17), "norm.weight": torch.randn(17), "pos": torch.arange(5)}
    plan = SyncPlan.of(w, dtype="bfloat16", bucket_mb=0.005)
    again = SyncPlan.from_json(plan.to_json())
    assert again == plan and again.fingerprint() == plan.fingerprint() and len(plan.bucket_sizes) > 1
    for bad in ("{", '{"format": 2}', '{"format": 1, "bucket_sizes": [1], "entries": [["x", "floaty", [1], 0, 0, 4]]}'):
        with pytest.raises(ValueError):
            SyncPlan.from_json(bad)


def test_one_sender_lands_the_same_bytes_in_two_receivers():
    g = torch.Generator().manual_seed(1)
    src = {"a.weight": torch.randn(200, 33, generator=g), "b.weight": torch.randn(33, generator=g)}
    dsts = [{k: torch.zeros_like(v) for k, v in src.items()} for _ in range(2)]
    plan, port = SyncPlan.of(src, bucket_mb=0.01), free_port()
    with ThreadPoolExecutor(2) as ex:
        got = [ex.submit(receive_weights, d, plan, addr="127.0.0.1", port=port, timeout_s=30, rank=r + 1, world_size=3)
               for r, d in enumerate(dsts)]
        sent = send_weights(src, plan, addr="127.0.0.1", port=port, timeout_s=30, world_size=3)
        reports = [f.result(timeout=60) for f in got]
    assert all(torch.equal(d[k], src[k]) for d in dsts for k in src)
    assert sent.digest == reports[0].digest == reports[1].digest == sync_checksum(src, "sha256")  # gloo: on the host
    assert sent.digest.split("-", 1)[1] == "sha256:" + hashlib.sha256(
        meta_digest(plan.layout()).encode() + b"".join(src[k].numpy().tobytes() for k in sorted(src))).hexdigest()
    packed = [sync_module._pack(plan, src, i, torch.device("cpu")) for i in range(len(plan.bucket_sizes))]
    assert buffers_checksum(plan, packed) == sync_checksum(src)  # what a CUDA IPC export reports (device sums)
    assert sync_checksum(src) != sync_checksum(src, "sha256")


# -- engines: fakes ----------------------------------------------------------------------------


class VLLMStyleModel:
    """An HF model behind vLLM's ``load_weights(weights) -> set[str]`` contract: a name must be a
    parameter (vLLM: ``params_dict[name]``), a shape must match (``default_weight_loader``'s
    assertion), a tied LM head is skipped (``AutoWeightsLoader(skip_prefixes=["lm_head."])``)."""

    def __init__(self, hf):
        self.hf = hf
        self.calls = 0

    def named_parameters(self):
        return self.hf.named_parameters()

    def load_weights(self, weights):
        self.calls += 1
        params, loaded = dict(self.hf.named_parameters()), set()
        for name, w in weights:
            if name.startswith("lm_head.") and self.hf.config.tie_word_embeddings:
                continue
            param = params[name]
            assert param.size() == w.size(), f"Attempted to load weight ({w.size()}) into parameter ({param.size()})"
            with torch.no_grad():
                param.data.copy_(w)
            loaded.add(name)
        return loaded


class FakeVLLMWorker(WeightReloadExtension):
    """What vLLM's GPU worker gives the extension: ``rank``, ``device``, ``model_runner.model``."""

    def __init__(self, hf, rank: int):
        self.rank, self.device = rank, torch.device("cpu")
        self.model_runner = SimpleNamespace(model=VLLMStyleModel(hf))


class FakeLLM(HFBackedLLM):
    """``vllm.LLM`` over tensor-parallel workers: ``collective_rpc`` runs the method on every
    worker at once (threads) and answers one result per worker, raising a worker's error."""

    def __init__(self, workers, tok):
        super().__init__(workers[0].model_runner.model.hf, tok)
        self.workers = workers

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "rft_receive_weights":
            return super().collective_rpc(method, args, kwargs)
        self.events.append(("collective_rpc", method))
        with ThreadPoolExecutor(len(self.workers)) as ex:
            futures = [ex.submit(getattr(w, method), *args, **(kwargs or {})) for w in self.workers]
            return [f.result() for f in futures]


class TensorSGLang(HFBackedSGLang):
    """``sglang.Engine`` with ``update_weights_from_tensor(named_tensors, load_format, flush_cache)``
    writing into its model; refuses an unknown name or shape as SGLang answers: (False, message)."""

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.events.append(("update_weights_from_tensor", len(named_tensors), flush_cache))
        params = dict(self.hf.model.named_parameters())
        for name, t in named_tensors:
            if name not in params or params[name].shape != t.shape:
                return False, f"Failed to update weights: {name} {tuple(t.shape)} does not fit the model", 0
        with torch.no_grad():
            for name, t in named_tensors:
                params[name].copy_(t)
        return True, "Succeeded to update model weights.", 0


class Sender:
    """The policy worker's side (``ModelWorker.prepare_weights`` / ``send_weights``) in threads."""

    def __init__(self, model, *, show_up: bool = True):
        self.tensors, self.show_up = state_tensors(model), show_up
        self.pool = ThreadPoolExecutor(1)

    def prepare(self, ref, dtype):
        plan = SyncPlan.of(self.tensors, dtype=dtype, bucket_mb=BUCKET_MB)
        return {"status": "ready", "addr": "127.0.0.1", "port": free_port(), "backend": "gloo", "plan": plan.to_json()}

    def send_async(self, ref, *, addr, port, dtype, backend, world_size):
        if not self.show_up:
            return None
        plan = SyncPlan.of(self.tensors, dtype=dtype, bucket_mb=BUCKET_MB)
        return self.pool.submit(send_weights, self.tensors, plan, addr=addr, port=port, backend=backend, timeout_s=20,
                                world_size=world_size)

    @staticmethod
    def wait(future):
        rep = future.result(timeout=60)
        return {"checksum": rep.digest, "digest": rep.digest, "bytes": rep.bytes}

    def pull(self, engine, timeout_s=20.0):
        return pull_into_engine(engine, REF, prepare=self.prepare, send_async=self.send_async, wait=self.wait,
                                timeout_s=timeout_s, bucket_mb=BUCKET_MB)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def _policy(tiny_model, seed):
    """The trainer's float32 model with other weights than the checkpoint's."""
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _other_layout(tiny_model):
    from transformers import LlamaForCausalLM

    cfg = load_causal_lm(tiny_model).config
    cfg.intermediate_size = 48
    return LlamaForCausalLM(cfg)


def _vllm(tiny_model, tok, tp: int):
    workers = [FakeVLLMWorker(load_causal_lm(tiny_model, dtype="bfloat16").eval(), rank) for rank in range(tp)]
    llm = FakeLLM(workers, tok)
    eos = HFEngine(workers[0].model_runner.model.hf, tok).eos_ids
    return VLLMEngine("/base", eos_ids=eos, llm=llm, sampling_params=SamplingParams, dtype="bfloat16",
                      tensor_parallel_size=tp), workers


def _equal_to_sent(hf, sender: Sender) -> bool:
    got = state_tensors(hf)
    return set(got) == set(sender.tensors) and all(
        torch.equal(got[k], sender.tensors[k].to(got[k].dtype)) for k in got)


# -- vLLM -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_workers_receive_the_trainers_weights_bit_for_bit(tiny_model, tok, tp):
    engine, workers = _vllm(tiny_model, tok, tp)
    sender = Sender(_policy(tiny_model, 1))
    rep = sender.pull(engine)
    assert rep["status"] == "synced" and rep["buckets"] > 1 and rep["backend"] == "gloo"
    assert all(_equal_to_sent(w.model_runner.model.hf, sender) for w in workers)
    cast = {k: v.to(torch.bfloat16) for k, v in sender.tensors.items()}
    assert rep["checksum"] == sync_checksum(cast, "sha256") == sync_checksum(state_tensors(workers[0].model_runner.model.hf),
                                                                             "sha256")  # gloo: checked on the host
    assert all(w.model_runner.model.calls == rep["buckets"] for w in workers)  # one load_weights per bucket
    assert engine.weights_version == f"path:{REF}" and engine.llm.events[-1] == ("reset_prefix_cache",)
    engine.generate([[1, 20, 30]], n_samples_per_prompt=1, max_new_tokens=2)
    assert not any(e[1] == "rft_reload_weights" for e in engine.llm.events if e[0] == "collective_rpc")


def test_vllm_sender_with_another_layout_fails_both_sides_and_invalidates_the_engine(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 2)
    sender = Sender(_other_layout(tiny_model))
    futures = []
    send = sender.send_async
    sender.send_async = lambda *a, **k: futures.append(send(*a, **k)) or futures[-1]
    mismatch = r"Attempted to load weight \(torch.Size\(\[32, 48\]\)\) into parameter \(torch.Size\(\[32, 64\]\)\)"
    with pytest.raises(WeightSyncError, match=mismatch):
        sender.pull(engine)
    with pytest.raises(WeightSyncError, match=r"receiver rank\(s\) \[1, 2\] could not land"):
        futures[0].result(timeout=30)
    assert engine.weights_version is None
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    engine.load_policy(tiny_model)  # a checkpoint load makes it servable again
    engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    assert ("collective_rpc", "rft_reload_weights", (tiny_model,)) in engine.llm.events


def test_vllm_sender_that_never_comes_fails_within_the_timeout(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 2)
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="rendezvous"):
        Sender(_policy(tiny_model, 1), show_up=False).pull(engine, timeout_s=1.5)
    assert time.perf_counter() - t0 < 15
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    rep = Sender(_policy(tiny_model, 2)).pull(engine)  # the next sync lands
    assert rep["status"] == "synced" and engine.weights_version == f"path:{REF}"


def test_storage_answer_and_lora_engines_move_nothing(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 1)

    def never(*a, **k):
        raise AssertionError("nothing may be sent")

    rep = pull_into_engine(engine, REF, prepare=lambda ref, dtype: {"status": "storage"}, send_async=never, wait=never,
                           timeout_s=5, bucket_mb=BUCKET_MB)
    assert rep == {"status": "storage"} and engine.weights_path == "/base"
    engine.lora_request = ("lora", "/adapter", 1)
    with pytest.raises(ValueError, match="LoRA"):
        pull_into_engine(engine, REF, prepare=never, send_async=never, wait=never, timeout_s=5, bucket_mb=BUCKET_MB)


def test_a_checksum_the_sender_disagrees_with_invalidates_the_engine(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 1)
    sender = Sender(_policy(tiny_model, 1))
    wait = sender.wait
    sender.wait = lambda f: {**wait(f), "checksum": "0" * 16 + "-" + "0" * 16}
    with pytest.raises(WeightSyncError, match="checksum"):
        sender.pull(engine)
    assert engine.weights_version is None and engine.weights_path is None


# -- SGLang -------------------------------------------------------------------------------------------


def _sglang(tiny_model, tok):
    fake = TensorSGLang(load_causal_lm(tiny_model, dtype="bfloat16").eval(), tok)
    return SGLangEngine("/base", eos_ids=HFEngine(fake.hf.model, tok).eos_ids, engine=fake, dtype="bfloat16"), fake


def test_sglang_engine_receives_the_trainers_weights_bit_for_bit(tiny_model, tok):
    engine, fake = _sglang(tiny_model, tok)
    sender = Sender(_policy(tiny_model, 3))
    rep = sender.pull(engine)
    assert _equal_to_sent(fake.hf.model, sender)
    assert rep["checksum"] == sync_checksum(state_tensors(fake.hf.model), "sha256") and rep["buckets"] > 1
    updates = [e for e in fake.events if e[0] == "update_weights_from_tensor"]
    assert len(updates) == rep["buckets"] and [e[2] for e in updates] == [False] * (len(updates) - 1) + [True]
    assert engine.weights_version == f"path:{REF}"
    engine.generate([[1, 20, 30]], n_samples_per_prompt=1, max_new_tokens=2)
    assert not any(e[0] == "update_weights_from_disk" for e in fake.events)


def test_sglang_refusal_and_missing_sender_invalidate_the_engine(tiny_model, tok):
    engine, fake = _sglang(tiny_model, tok)
    with pytest.raises(WeightSyncError, match="does not fit the model"):
        Sender(_other_layout(tiny_model)).pull(engine)
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    with pytest.raises(WeightSyncError, match="rendezvous"):
        Sender(_policy(tiny_model, 1), show_up=False).pull(engine, timeout_s=1.5)
    assert engine.weights_version is None


# -- make_engine inside a resident worker --------------------------------------------------------------


def test_make_engine_takes_the_weights_from_the_resident_worker(tiny_model, monkeypatch):
    from rft_core.config import load_config
    from rft_core.engines import release_engine
    from rft_core.engines import vllm as vllm_module
    from rft_core.stages.rollout import make_engine
    from rft_core.workers.memory import models_from

    built = []
    monkeypatch.setattr(vllm_module, "build_llm", lambda **kw: built.append(kw) or HFBackedLLM(
        load_causal_lm(tiny_model).eval(), load_tokenizer(tiny_model)))
    monkeypatch.setattr(vllm_module, "vllm_sampling_params", lambda: SamplingParams)

    class Source:
        calls: list = []

        def engine_policy(self, engine, ref):
            self.calls.append((engine, ref))

    cfg = load_config(None, {"rollout.engine": "vllm"}).rollout
    release_engine()
    try:
        with models_from(Source()):
            first, _ = make_engine(cfg, tiny_model, dtype="bfloat16")
            again, _ = make_engine(cfg, tiny_model, dtype="bfloat16")
        assert again is first and len(built) == 1 and built[0]["model"] == tiny_model
        assert [c[0] for c in Source.calls] == [first, first] and [c[1] for c in Source.calls] == [tiny_model] * 2
        assert first.llm.events == []  # reused without load_policy: the worker's sync decides the weights
    finally:
        release_engine()


def test_resident_rollout_worker_syncs_its_vllm_engine_from_the_policy_actor(tiny_model, tok, tmp_path):
    """The real pieces around the engine: the policy worker is a Ray actor holding the trainer of
    a committed update (run there by ``run_resident``); the rollout worker's ``engine_policy``
    asks it for the plan in the engine's dtype, and the actor broadcasts over gloo into the two
    tensor-parallel workers of the vLLM engine. The engine then holds the update's weights (cast
    to bfloat16), once: asking again moves nothing."""
    pytest.importorskip("ray")
    from rft_core.config import WorkersConfig, load_config
    from rft_core.stages.runner import run_stage
    from rft_core.workers.pool import run_resident, stop_workers
    from rft_core.workers.resident import ModelWorker, version_key
    from tests.drive import drive

    cfg = load_config(None, ["data.prompts_per_iteration=2", "data.size=20", "rollout.n_samples_per_prompt=2",
                             "rollout.max_new_tokens=4", "update.micro_batch_size=4", "iterations=1",
                             f"policy.path={tiny_model}", f"run_root={tmp_path / 'run'}"])
    workers = WorkersConfig(pool=str(tmp_path / "run"), threads=1)
    try:
        ref1 = drive(cfg, lambda inp: run_resident(inp, workers) if inp.program == "ppo_update" else run_stage(inp))
        engine, vllm_workers = _vllm(tiny_model, tok, 2)
        rollout = ModelWorker("rollout", workers.pool)
        rollout.engine_policy(engine, ref1)
        rollout.engine_policy(engine, ref1)
    finally:
        stop_workers(workers.pool)
    want = load_causal_lm(f"{ref1.uri}/policy", dtype="bfloat16").state_dict()
    for w in vllm_workers:
        got = w.model_runner.model.hf.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert engine.weights_version == version_key(ref1)
    assert [s["engine"] for s in rollout.syncs] == ["VLLMEngine"] and rollout.syncs[0]["backend"] == "gloo"


def test_checksum_methods_follow_the_backend_and_refuse_out_of_order_tensors():
    from rft_core.workers.checksum import Checksum, checksum_method

    assert [checksum_method(b) for b in ("gloo", "local", "nccl", "cuda_ipc")] == ["sha256", "sha256", "device", "device"]
    t = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    layout = [(k, t[k].dtype, tuple(t[k].shape)) for k in sorted(t)]
    c = Checksum(layout, "sha256")
    with pytest.raises(ValueError, match="'b' added where the layout has 'a' next"):
        c.add("b", t["b"])
    with pytest.raises(ValueError, match="unknown checksum method 'md5'"):
        Checksum(layout, "md5")
    flipped = t["a"].clone()
    flipped.view(torch.int32)[3] ^= 1
    assert sync_checksum({**t, "a": flipped}, "sha256") != sync_checksum(t, "sha256")
