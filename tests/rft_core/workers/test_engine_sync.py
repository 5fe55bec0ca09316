"""In-memory weight sync into the GPU engines (``rft_core.weightsync.session.pull`` into
``IntoEngine``: the vLLM worker extension, SGLang's update_weights_from_tensor) and the
device-side digest (``weights_digest(..., "device")``).

No GPU here: vLLM and SGLang are the strict stand-ins of ``tests/standins`` (vLLM 0.33.0, SGLang
0.5.23; what each copies is in its docstring): the engines hold fused (q/k/v, gate/up),
tensor-parallel-sharded parameters loaded through their own ``load_weights`` from HF names,
vLLM's executor keeps a reply queue per worker as ``multiproc_executor.py`` does, SGLang has its
weight-update session and refuses a cache flush while requests run. The project's
``WeightReloadExtension`` runs in the vLLM stand-in's workers (tensor parallel 2 = two receivers
in one group). The gloo process groups, the plans, the checksums and the engines' bookkeeping are
the real ones; the sender runs ``send_weights`` in a thread. Every message a test matches is the
project's."""
from __future__ import annotations

import dataclasses
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from rft_core.engines import ENGINE_CACHE
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine
from rft_core.engines.vllm import WORKER_EXTENSION, VLLMEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.network import free_port
from rft_core.weightsync import plan as sync_module
from rft_core.weightsync.base import OWN_WAIT_SHARE
from rft_core.weightsync.checksum import CHUNK, M31, meta_digest, multipliers, name_weight, row_weights, word_sums
from rft_core.weightsync.collective import receive_weights, send_weights
from rft_core.weightsync.cuda_ipc import buffers_digest
from rft_core.weightsync.digest import weights_digest
from rft_core.weightsync.landing import IntoEngine
from rft_core.weightsync.plan import SyncPlan, SyncReport, WeightSyncError, state_tensors
from rft_core.weightsync.session import Offer, pull
from tests.rft_core.engines.fakes import HFBackedLLM, SamplingParams
from tests.standins import sglang as sglang_standin
from tests.standins import vllm as vllm_standin
from tests.standins.engine_model import to_hf

BUCKET_MB = 0.05  # several buckets for the tiny model (its embedding gets one of its own)
REF = "/policies/v1"  # a policy version (its key: "path:/policies/v1")

# -- the device digest --------------------------------------------------------------------------


def device_sums(tensors) -> str:
    """The ``device`` method of the weight digest (``rft_core.weightsync.checksum``)."""
    return weights_digest(tensors, "device")



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
    assert device_sums({"w": t}) == f"{layout_hex}-{s[0] * name_weight('w') & M31:08x}{s[1] * name_weight('w') & M31:08x}"
    # pinned: the same string on every machine and release (sender and receiver may differ)
    assert device_sums({"w": t}) == "c3315bc3c39e06b4-26ce512b7d9b417f"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_checksum_equals_the_python_reference_and_sees_every_flipped_bit(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, generator=g) * 1000).to(dtype)
    assert word_sums(t).tolist() == _ref_sums(t)
    base = device_sums({"a": t})
    raw = t.view(torch.uint8).reshape(-1)
    for i in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[i] ^= 1 << bit
            assert device_sums({"a": flipped.view(dtype).reshape(t.shape)}) != base, (i, bit)


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
    base = device_sums({"a": a})
    assert device_sums({"a": a[[1, 0, 2, 3, 4, 5]]}) != base  # two words swapped
    assert device_sums({"b": a}) != base
    assert device_sums({"a": a.reshape(2, 3)}) != base
    assert device_sums({"a": a.view(torch.int32)}) != base
    assert device_sums({"a": a, "b": a + 1}) != device_sums({"a": a + 1, "b": a})
    assert device_sums({"a": a.clone()}) == base and device_sums({"a": torch.zeros(0)}) != device_sums({})


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
    assert sent.digest == reports[0].digest == reports[1].digest == weights_digest(src, "xxh3")  # gloo: on the host
    leaves = b"".join(xxhash.xxh3_128_digest(src[k].numpy().tobytes()) for k in sorted(src))  # one 8 MiB piece each
    assert sent.digest == meta_digest(plan.layout())[:16] + "-xxh3:" + xxhash.xxh3_128(leaves).hexdigest()
    packed = [sync_module.pack_bucket(plan, src, i, torch.device("cpu")) for i in range(len(plan.bucket_sizes))]
    assert buffers_digest(plan, packed) == device_sums(src)  # what a CUDA IPC send reports (device sums)
    assert device_sums(src) != weights_digest(src, "xxh3")


# -- engines: the strict stand-ins of tests/standins ------------------------------------------------


class Sender:
    """The policy worker's send leg (``rft_core.weightsync.session.SendLeg``, as
    ``PolicyWorker.prepare_weights`` / ``send_weights`` do it) in threads."""

    local = False

    def __init__(self, tensors, *, show_up: bool = True, joins: bool = True, dtype: str | None = None,
                 timeout_s: float = 20.0):
        self.tensors = tensors if isinstance(tensors, dict) else state_tensors(tensors)
        self.show_up, self.dtype = show_up, dtype  # dtype: send in this one, not the engine's
        self.joins = joins  # False: it opens the rendezvous (its store) and never joins the group
        self.timeout_s = timeout_s  # the policy worker's sync_timeout_s: its own waits get OWN_WAIT_SHARE of it
        self.pool = ThreadPoolExecutor(1)
        self.futures: list = []

    def offer(self, dtype):
        plan = SyncPlan.of(self.tensors, dtype=self.dtype or dtype, bucket_mb=BUCKET_MB)
        return Offer(backend="gloo", device="cpu", host="elsewhere", addr="127.0.0.1", port=free_port(),
                     plan=plan.to_json())

    def start(self, meet):
        if not self.show_up:
            return None
        if not self.joins:
            import datetime as dt

            import torch.distributed as dist

            self.store = dist.TCPStore(meet.addr, meet.port, world_size=meet.world_size, is_master=True,
                                       wait_for_workers=False, timeout=dt.timedelta(seconds=self.timeout_s))
            self.futures.append(self.pool.submit(lambda: (_ for _ in ()).throw(WeightSyncError("never joined"))))
            return self.futures[-1]
        plan = SyncPlan.of(self.tensors, dtype=self.dtype or meet.dtype, bucket_mb=BUCKET_MB)
        self.futures.append(self.pool.submit(send_weights, self.tensors, plan, addr=meet.addr, port=meet.port,
                                             backend=meet.backend, timeout_s=self.timeout_s * OWN_WAIT_SHARE,
                                             world_size=meet.world_size))
        return self.futures[-1]

    def wait(self, future) -> SyncReport:
        """The send's report; TimeoutError after ``timeout_s`` (the policy gang's wait: ``Gang.wait``)."""
        return future.result(timeout=self.timeout_s)

    def cancel(self, future) -> None:
        pass

    def finish(self, meet) -> None:
        pass

    def pull(self, engine, timeout_s=20.0) -> SyncReport | None:
        return pull(self, IntoEngine(engine), version=f"path:{REF}", timeout_s=timeout_s, bucket_mb=BUCKET_MB)


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


def _vllm(tiny_model, tok, tp: int, **kw):
    """A ``VLLMEngine`` on the vLLM stand-in: ``tp`` workers (the project's worker extension mixed
    in) holding ``tiny_model``'s checkpoint in bfloat16, fused and sharded."""
    llm = vllm_standin.LLM(tiny_model, tensor_parallel_size=tp, dtype="bfloat16", worker_extension_cls=WORKER_EXTENSION,
                           enable_sleep_mode=kw.get("enable_sleep_mode", False))
    return VLLMEngine(tiny_model, eos_ids=HFEngine(llm.hf.model, tok).eos_ids, llm=llm, sampling_params=SamplingParams,
                      dtype="bfloat16", tensor_parallel_size=tp, **kw), llm


def _shards(llm) -> list:
    return [w.model_runner.model for w in llm.workers]


def _holds(shards, tensors) -> bool:
    """The engine's shards hold exactly ``tensors`` cast to bfloat16 (every HF tensor, nothing more)."""
    got = to_hf(shards)
    return set(got) == set(tensors) and all(torch.equal(got[k], tensors[k].to(torch.bfloat16)) for k in got)


def _without(tensors, name):
    return {k: v for k, v in tensors.items() if k != name}


# -- vLLM -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_workers_receive_the_trainers_weights_bit_for_bit(tiny_model, tok, tp):
    engine, llm = _vllm(tiny_model, tok, tp)
    sender = Sender(_policy(tiny_model, 1))
    assert not _holds(_shards(llm), sender.tensors)  # the check below can fail: the engine starts elsewhere
    loads = [s.loads for s in _shards(llm)]
    rep = sender.pull(engine)
    assert rep.buckets > 1 and rep.backend == "gloo" and rep.extra["transport"] == "vllm"
    assert _holds(_shards(llm), sender.tensors)  # fused q/k/v and gate/up, sharded over tp workers
    cast = {k: v.to(torch.bfloat16) for k, v in sender.tensors.items()}
    assert rep.digest == weights_digest(cast, "xxh3") == weights_digest(to_hf(_shards(llm)), "xxh3")
    assert [s.loads - n for s, n in zip(_shards(llm), loads)] == [rep.buckets] * tp  # one load_weights per bucket
    assert engine.weights_version == f"path:{REF}" and llm.events[-1] == ("reset_prefix_cache",)
    engine.generate([[1, 20, 30]], n_samples_per_prompt=1, max_new_tokens=2)
    assert not any(e[1] == "rft_reload_weights" for e in llm.events if e[0] == "collective_rpc")


def test_vllm_refuses_a_sync_of_another_layout_on_every_worker_before_a_bucket_moves(tiny_model, tok):
    engine, llm = _vllm(tiny_model, tok, 2)
    before = to_hf(_shards(llm))
    sender = Sender(_other_layout(tiny_model))
    with pytest.raises(WeightSyncError, match=r"failed on worker\(s\) \[0, 1\]: WeightSyncError: the sync does not fit the "
                                              r"VLLMEngine's model .*'model.layers.0.mlp.down_proj.weight' has shape "
                                              r"\(32, 48\), the engine's model \(32, 64\)"):
        sender.pull(engine)
    with pytest.raises(WeightSyncError, match=r"receiver rank\(s\) \[1, 2\] refused the sender's weights at the plan check"):
        sender.futures[0].result(timeout=30)
    assert all(torch.equal(before[k], v) for k, v in to_hf(_shards(llm)).items())  # nothing landed
    assert engine.weights_version is None
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    engine.load_policy(tiny_model)  # a checkpoint load makes it servable again
    engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    assert ("collective_rpc", "rft_reload_weights", (tiny_model,)) in llm.events


@pytest.mark.parametrize("change", ["missing", "unexpected", "dtype"])
def test_vllm_refuses_an_incomplete_or_mis_shaped_sync(tiny_model, tok, change):
    """The project's check (``plan_refusal``) names what does not fit; nothing lands."""
    engine, llm = _vllm(tiny_model, tok, 2)
    tensors = state_tensors(_policy(tiny_model, 1))
    if change == "missing":
        tensors, want = _without(tensors, "model.norm.weight"), r"1 tensor\(s\) missing \['model.norm.weight'\]"
    elif change == "unexpected":
        tensors, want = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, \
            r"1 unexpected \['lm_head.weight'\]"
    else:  # a sender that plans in another dtype than the engine's
        want = r"'model.embed_tokens.weight' comes in float16, the engine runs in bfloat16"
    before = to_hf(_shards(llm))
    with pytest.raises(WeightSyncError, match=want):
        Sender(tensors, dtype="float16" if change == "dtype" else None).pull(engine)
    assert all(torch.equal(before[k], v) for k, v in to_hf(_shards(llm)).items())
    assert engine.weights_version is None


def test_vllm_workers_refuse_a_sync_that_leaves_a_parameter_out(tiny_model, tok):
    """Below the project's plan check, the worker extension itself refuses a sync after which a
    parameter of the vLLM model was never loaded (vLLM 0.33 only logs it: ``reload_weights``,
    model_loader/reload/inplace.py), and answers its failure instead of raising it."""
    _, llm = _vllm(tiny_model, tok, 2)
    tensors = _without(state_tensors(_policy(tiny_model, 1)), "model.layers.1.post_attention_layernorm.weight")
    plan, port = SyncPlan.of(tensors, dtype="bfloat16", bucket_mb=BUCKET_MB), free_port()
    with ThreadPoolExecutor(1) as ex:
        sent = ex.submit(send_weights, tensors, plan, addr="127.0.0.1", port=port, timeout_s=20, world_size=3)
        answers = llm.collective_rpc("rft_receive_weights", args=(plan.to_json(), "127.0.0.1", port, 3, "gloo", 20.0))
        with pytest.raises(WeightSyncError, match=r"rank\(s\) \[1, 2\] could not land"):
            sent.result(timeout=30)
    assert [a["ok"] for a in answers] == [False, False] and [a["rank"] for a in answers] == [0, 1]
    assert all("1 parameter(s) of the vLLM model were not in the sync: "
               "['model.layers.1.post_attention_layernorm.weight']" in a["error"] for a in answers)
    assert all(q.empty() for q in llm.executor.responses)


def test_vllm_failed_sync_leaves_no_reply_queued_for_the_next_call(tiny_model, tok):
    """Finding 4 (issue 36): a sync that fails on every worker (the sender never joins) is read
    to the end; vLLM's executor would otherwise leave worker 1's failure queued for the next
    ``collective_rpc``, failing the sync after it."""
    engine, llm = _vllm(tiny_model, tok, 2)
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError) as failed:  # the sender opens the rendezvous and never joins the group
        Sender(_policy(tiny_model, 1), joins=False, timeout_s=2.0).pull(engine, timeout_s=2.0)
    assert time.perf_counter() - t0 < 15
    assert [q.qsize() for q in llm.executor.responses] == [0, 0], "a worker's reply is left queued"
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    sender = Sender(_policy(tiny_model, 2))
    rep = sender.pull(engine)  # the next sync lands
    assert rep is not None and engine.weights_version == f"path:{REF}" and _holds(_shards(llm), sender.tensors)
    assert re.search(r"failed on worker\(s\) \[0, 1\]: WeightSyncError: weight sync rendezvous .* \(rank 1 of 3\).*; "
                     r"WeightSyncError: weight sync rendezvous .* \(rank 2 of 3\)", str(failed.value))


def test_vllm_synced_weights_survive_a_level_1_sleep(tiny_model, tok):
    """Sleep mode after a sync: level 1 (the weights are on no storage) offloads them to the
    CPU and the next ``generate`` wakes them back; a level-2 sleep would discard them, and the
    engine then holds itself invalid."""
    engine, llm = _vllm(tiny_model, tok, 2, enable_sleep_mode=True)
    sender = Sender(_policy(tiny_model, 1))
    sender.pull(engine)
    engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    assert llm.events[-1] == ("sleep", 1) and all(w.asleep for w in llm.workers)
    assert all(torch.isnan(p).all() for s in _shards(llm) for _, p in s.named_parameters())  # the GPU copy is gone
    engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    assert llm.events[-4:] == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("generate", 1), ("sleep", 1)]
    engine.wake_up()
    assert _holds(_shards(llm), sender.tensors) and engine.weights_version == f"path:{REF}"
    engine.sleep(level=2)
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)


def test_storage_answer_and_lora_engines_move_nothing(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 1)

    class Never(Sender):
        def offer(self, dtype):
            return None  # the policy worker does not hold the version and it is on storage

        def start(self, meet):
            raise AssertionError("nothing may be sent")

    assert Never({}).pull(engine) is None and engine.weights_path == tiny_model
    engine.lora = True  # built with LoRA
    with pytest.raises(ValueError, match="LoRA"):
        Sender({}).pull(engine)


def test_a_checksum_the_sender_disagrees_with_invalidates_the_engine(tiny_model, tok):
    engine, _ = _vllm(tiny_model, tok, 1)
    sender = Sender(_policy(tiny_model, 1))
    wait = sender.wait
    sender.wait = lambda f: dataclasses.replace(wait(f), digest="0" * 16 + "-" + "0" * 16)
    with pytest.raises(WeightSyncError, match="the landed weights' digest .* differs from the sent 0{16}-0{16}"):
        sender.pull(engine)
    assert engine.weights_version is None and engine.weights_path is None


# -- unbounded waits and dead engines (issue 45) ----------------------------------------------------

# the fault tests' orchestration.sync_timeout_s: small, so that they fail fast, and 4 s or more, so that a
# participant's own waits (OWN_WAIT_SHARE of it) end before it through torch's whole-second rendezvous
SYNC_TIMEOUT_S = 4.5
SLACK_S = 1.0  # thread scheduling on a loaded 2-core machine, over the timeout


def _within(seconds: float, call) -> dict:
    """``call()`` in a daemon thread: {"value" or "error", "seconds"}. AssertionError when it has
    not returned after ``seconds`` (an unbounded wait; the thread is left behind)."""
    box: dict = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001  reported to the test
            box["error"] = exc
        box["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: an unbounded wait"
    return box


def _closing_seconds(engine) -> list[float]:
    """The seconds ``engine.close`` takes, recorded when it runs (closing a dead engine: its
    processes, gc and the device memory; it comes on top of the sync's limit)."""
    took, close = [], engine.close

    def timed() -> None:
        t0 = time.perf_counter()
        close()
        took.append(time.perf_counter() - t0)

    engine.close = timed
    return took


def _cached_vllm(tiny_model, tok, monkeypatch):
    """The process's cached ``VLLMEngine`` (tensor parallel 2, the resident worker's ``reload=False``) built by the
    project's ``build_llm`` on the vLLM stand-in (``import vllm``)."""
    from rft_core.engines.vllm import get_vllm_engine

    vllm_standin.install(monkeypatch)
    return get_vllm_engine(tiny_model, eos_ids={tok.eos_token_id}, tensor_parallel_size=2, dtype="bfloat16",
                           reload=False)


def _lands_in_a_new_engine(tiny_model, tok, monkeypatch, dead) -> None:
    """The next iteration's engine is a new one (the dead one is closed and out of the cache) and a sync lands in it."""
    assert dead.dead and dead.llm is None and ENGINE_CACHE.peek() is None
    again = _cached_vllm(tiny_model, tok, monkeypatch)
    assert again is not dead
    sender = Sender(_policy(tiny_model, 2), timeout_s=SYNC_TIMEOUT_S)
    assert sender.pull(again, timeout_s=SYNC_TIMEOUT_S) is not None
    assert _holds(_shards(again.llm), sender.tensors)


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py); the vLLM sync's other failure tests run every time
def test_vllm_receive_timeout_fails_the_sync_within_sync_timeout_and_the_engine_is_rebuilt(tiny_model, tok, monkeypatch):
    """Issue 45, finding 2: a vLLM worker that never answers (stuck before it joins the sync group,
    as NCCL's communicator setup blocks when a peer never arrives). ``LLM.collective_rpc`` waits
    forever without a timeout; the engine's receive gives it ``sync_timeout_s``. The sync fails
    with ``WeightSyncError`` within ``sync_timeout_s`` (closing the dead engine comes on top),
    after the sender's own failure was awaited
    (the policy worker is free for its next call); the engine, with a call still pending in its
    executor, is closed, and the next iteration's engine is a new one into which a sync lands."""
    from rft_core.engines import release_engine

    release_engine()
    try:
        engine = _cached_vllm(tiny_model, tok, monkeypatch)
        llm = engine.llm
        llm.workers[1].hang = threading.Event()  # never set: worker 1 never answers
        sender, closing = Sender(_policy(tiny_model, 1), timeout_s=SYNC_TIMEOUT_S), _closing_seconds(engine)
        got = _within(SYNC_TIMEOUT_S + 20, lambda: sender.pull(engine, timeout_s=SYNC_TIMEOUT_S))
        assert isinstance(got.get("error"), WeightSyncError), got
        assert "TimeoutError: RPC call to rft_receive_weights timed out" in str(got["error"])
        assert got["seconds"] - sum(closing) < SYNC_TIMEOUT_S + SLACK_S, (got["seconds"], closing)
        assert sender.futures[0].done()  # awaited: it failed on its own (its rendezvous) before the sync failed
        assert llm.closed
        _lands_in_a_new_engine(tiny_model, tok, monkeypatch, engine)
    finally:
        release_engine()


@pytest.mark.rotation(6)  # long: one turn in 8 (tests/rotation.py); the vLLM sync's other failure tests run every time
def test_vllm_worker_in_setup_dies_fails_the_sync_within_sync_timeout_and_the_engine_is_rebuilt(tiny_model, tok,
                                                                                             monkeypatch):
    """Issue 45, finding 2: a peer that dies during the sync's setup (vLLM worker 1's process dies
    as the call reaches it, before it joins the group): vLLM's executor fails at once
    (``EngineDeadError``), while the sender and worker 0 wait at the rendezvous for the dead rank.
    The sync fails with ``WeightSyncError`` within ``sync_timeout_s`` (closing the dead engine
    comes on top), and not before the sender has been awaited (it fails on its own at the rendezvous: the policy gang is not left busy for
    its next call); the dead engine is closed and the next iteration builds a new one."""
    from rft_core.engines import release_engine

    release_engine()
    try:
        engine = _cached_vllm(tiny_model, tok, monkeypatch)
        llm = engine.llm
        llm.workers[1].die = True
        sender, closing = Sender(_policy(tiny_model, 1), timeout_s=SYNC_TIMEOUT_S), _closing_seconds(engine)
        got = _within(SYNC_TIMEOUT_S + 20, lambda: sender.pull(engine, timeout_s=SYNC_TIMEOUT_S))
        assert isinstance(got.get("error"), WeightSyncError), got
        assert "EngineDeadError" in str(got["error"])
        assert got["seconds"] - sum(closing) < SYNC_TIMEOUT_S + SLACK_S, (got["seconds"], closing)
        assert sender.futures[0].done()  # awaited before the sync failed
        with pytest.raises(WeightSyncError, match="rendezvous"):
            sender.futures[0].result(timeout=0)
        assert llm.closed
        _lands_in_a_new_engine(tiny_model, tok, monkeypatch, engine)
    finally:
        release_engine()


def test_a_dead_engine_is_closed_and_the_next_iteration_builds_a_new_one(tiny_model, tok, monkeypatch):
    """Issue 45, finding 3: the executor of the cached vLLM engine dies during a sync (worker 1's
    process dies as it loads the second bucket). Before, nothing released the dead engine: it
    stayed cached and every later sync into it failed until the driver restarted. Now the sync
    fails with ``WeightSyncError``, the dead engine is closed (its GPU memory back) and refuses
    to serve, and the next iteration's engine is a new one into which a sync lands."""
    from rft_core.engines import release_engine

    release_engine()
    try:
        engine = _cached_vllm(tiny_model, tok, monkeypatch)
        llm = engine.llm
        model, loads = llm.workers[1].model_runner.model, []
        real = model.load_weights

        def dying(weights):
            loads.append(1)
            if len(loads) == 2:
                raise vllm_standin.WorkerDied("worker 1's process died while loading bucket 2")
            return real(weights)

        model.load_weights = dying
        with pytest.raises(WeightSyncError, match="EngineDeadError"):
            Sender(_policy(tiny_model, 1), timeout_s=SYNC_TIMEOUT_S).pull(engine, timeout_s=SYNC_TIMEOUT_S)
        assert llm.closed and len(loads) == 2
        with pytest.raises(RuntimeError, match="the vLLM engine died"):
            engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
        _lands_in_a_new_engine(tiny_model, tok, monkeypatch, engine)
    finally:
        release_engine()


# -- SGLang -------------------------------------------------------------------------------------------


def _sglang(tiny_model, tok, *, session=True, tp=1):
    """An ``SGLangEngine`` on the SGLang stand-in (0.5.23 with ``session``, else an older release)."""
    cls = sglang_standin.Engine if session else sglang_standin.OlderEngine
    fake = cls(model_path=tiny_model, tp_size=tp, dtype="bfloat16", skip_tokenizer_init=True,
               enable_deterministic_inference=True)
    return SGLangEngine(tiny_model, eos_ids=HFEngine(fake.hf.model, tok).eos_ids, engine=fake, dtype="bfloat16"), fake


@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_sync_runs_inside_a_weight_update_session(tiny_model, tok, tp):
    """Finding 2 (issue 36): SGLang 0.5.21+ answers success=False to an update outside
    ``begin_weight_update()`` .. ``end_weight_update()``; every bucket lands inside one session."""
    engine, fake = _sglang(tiny_model, tok, tp=tp)
    sender = Sender(_policy(tiny_model, 3))
    assert not _holds(fake.shards, sender.tensors)
    rep = sender.pull(engine)
    assert _holds(fake.shards, sender.tensors)
    assert rep.digest == weights_digest(to_hf(fake.shards), "xxh3") and rep.buckets > 1
    kinds = [e[0] for e in fake.events]
    n = rep.buckets
    assert kinds == ["begin_weight_update"] + ["update_weights_from_tensor"] * n + ["end_weight_update"]
    assert [e[2] for e in fake.events[1:-1]] == [False] * (n - 1) + [True]  # the cache flushed once, at the end
    assert engine.weights_version == f"path:{REF}"
    engine.generate([[1, 20, 30]], n_samples_per_prompt=1, max_new_tokens=2)
    assert not any(e[0] == "update_weights_from_disk" for e in fake.events)


def test_sglang_before_0_5_21_gets_the_updates_without_a_session(tiny_model, tok):
    engine, fake = _sglang(tiny_model, tok, session=False)
    sender = Sender(_policy(tiny_model, 3))
    sender.pull(engine)
    assert _holds(fake.shards, sender.tensors)
    assert {e[0] for e in fake.events} == {"update_weights_from_tensor"}


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_sglang_refuses_an_incomplete_or_mis_shaped_sync_before_sglang_sees_it(tiny_model, tok, change):
    """SGLang itself would skip an unknown name, never notice a missing one, and die on a tensor
    of another shape (the stand-in's ``SchedulerCrash``): the project's check refuses all three
    at the plan check, names what does not fit, and the engine stays alive and untouched."""
    engine, fake = _sglang(tiny_model, tok)
    policy = _policy(tiny_model, 1)
    tensors = state_tensors(policy)
    if change == "missing":
        tensors, want = _without(tensors, "model.layers.0.mlp.up_proj.weight"), \
            r"1 tensor\(s\) missing \['model.layers.0.mlp.up_proj.weight'\]"
    elif change == "unexpected":
        tensors, want = {**tensors, "model.layers.0.self_attn.rotary.weight": torch.ones(4)}, \
            r"1 unexpected \['model.layers.0.self_attn.rotary.weight'\]"
    else:
        tensors, want = state_tensors(_other_layout(tiny_model)), r"'model.layers.0.mlp.down_proj.weight' has shape"
    before = to_hf(fake.shards)
    sender = Sender(tensors)
    with pytest.raises(WeightSyncError, match=r"the sync does not fit the SGLangEngine's model .*" + want):
        sender.pull(engine)
    with pytest.raises(WeightSyncError, match=r"receiver rank\(s\) \[1\] refused the sender's weights at the plan check"):
        sender.futures[0].result(timeout=30)
    assert not any(e[0] == "update_weights_from_tensor" for e in fake.events) and fake.dead is None
    assert all(torch.equal(before[k], v) for k, v in to_hf(fake.shards).items())
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)
    good = Sender(policy)
    good.pull(engine)  # the session was never opened or was closed: the next sync lands
    assert _holds(fake.shards, good.tensors)


def test_sglang_on_its_own_takes_an_incomplete_update_and_dies_on_a_mis_shaped_one(tiny_model, tok):
    """Why the project checks the plan first: the SGLang stand-in (0.5.23's loaders) reports
    success for an update that carries one tensor of the model's 20, skips an unknown name, and
    its scheduler dies on a tensor of another shape, taking the engine with it."""
    fake = sglang_standin.Engine(model_path=tiny_model, dtype="bfloat16")
    assert fake.begin_weight_update() == (True, "Success")
    norm = ("model.norm.weight", torch.full((32,), 2.0, dtype=torch.bfloat16))
    assert fake.update_weights_from_tensor([norm, ("model.unknown.weight", torch.ones(3))], flush_cache=False)[0]
    assert torch.equal(fake.shards[0].param("model.norm.weight").data, norm[1])
    with pytest.raises(sglang_standin.SchedulerCrash):
        fake.update_weights_from_tensor([("model.norm.weight", torch.ones(33, dtype=torch.bfloat16))])
    with pytest.raises(RuntimeError):
        fake.generate(input_ids=[[1, 20]], sampling_params=[{}], return_logprob=True)


def test_sglang_refused_cache_flush_fails_the_sync_and_closes_the_session(tiny_model, tok):
    """Requests still running when the last bucket asks for the flush: SGLang 0.5.23 answers
    failure; the sync fails naming the bucket, the engine is invalid, the session is closed."""
    engine, fake = _sglang(tiny_model, tok)
    fake.running = 1
    with pytest.raises(WeightSyncError, match=r"SGLang update_weights_from_tensor \(bucket (\d+)/\1\) failed"):
        Sender(_policy(tiny_model, 1)).pull(engine)
    assert fake.events[-1] == ("end_weight_update",) and engine.weights_version is None
    fake.running = 0
    sender = Sender(_policy(tiny_model, 2))
    sender.pull(engine)
    assert _holds(fake.shards, sender.tensors) and engine.weights_version == f"path:{REF}"


def test_sglang_missing_sender_invalidates_the_engine_and_closes_the_session(tiny_model, tok):
    engine, fake = _sglang(tiny_model, tok)
    with pytest.raises(WeightSyncError, match="rendezvous"):
        Sender(_policy(tiny_model, 1), show_up=False).pull(engine, timeout_s=1.5)
    assert engine.weights_version is None and [e[0] for e in fake.events] == ["begin_weight_update", "end_weight_update"]
    with pytest.raises(WeightSyncError, match="invalid"):
        engine.generate([[1, 20]], n_samples_per_prompt=1, max_new_tokens=2)


# -- make_engine inside a resident worker --------------------------------------------------------------


def test_make_engine_takes_the_weights_from_the_resident_worker(tiny_model, monkeypatch):
    from rft_core.config import load_config
    from rft_core.engines import release_engine
    from rft_core.engines import vllm as vllm_module
    from rft_core.stages.rollout import make_engine
    from rft_core.stages.sources import models_from

    built = []
    monkeypatch.setattr(vllm_module, "build_llm", lambda **kw: built.append(kw) or HFBackedLLM(
        load_causal_lm(tiny_model).eval(), load_tokenizer(tiny_model), **kw))
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


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_first_rollout_of_a_resident_run_comes_before_any_update(kind, tiny_model, tmp_path, monkeypatch):
    """Issue 45, finding 1: iteration 1's rollout runs before any ``ppo_update`` has started the
    policy gang (the flow's order, ``tests/drive.py``). The rollout worker's engine is built from
    the initial checkpoint (``import vllm`` / ``import sglang`` are the stand-ins, so the project's
    own ``build_llm`` / ``build_engine`` pass them their engine arguments), and Ray finds no policy
    actor (the Ray stand-in: ``ray.get_actor`` raises as Ray does). The rollout goes through on
    the engine as built: nothing reloaded, nothing synced, the samples those of a stage-mode
    rollout of the same checkpoint on the same engine."""
    from rft_core.config import load_config
    from rft_core.engines import release_engine
    from rft_core.stages.contracts import PromptsInput, RolloutInput
    from rft_core.stages.runner import run_stage
    from rft_core.workers.rollout import RolloutWorker
    from schemas import read_shard, stage_uri
    from tests.standins import ray as ray_standin

    ray = ray_standin.install(monkeypatch)  # a cluster on which no policy worker runs yet
    (vllm_standin if kind == "vllm" else sglang_standin).install(monkeypatch)
    cfg = load_config(None, [f"policy.path={tiny_model}", f"run_root={tmp_path / 'run'}", f"rollout.engine={kind}",
                             "orchestration.workers=resident", "data.prompts_per_iteration=2", "data.size=8",
                             "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4"])
    prompts = run_stage(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1,
                                     out=stage_uri(cfg.run_root, 1, "prompts")))

    def rollout(out: str) -> RolloutInput:
        return RolloutInput(prompts=prompts, policy=tiny_model, policy_version=0, rollout=cfg.rollout, iteration=1,
                            dtype=cfg.policy.dtype, out=out)

    worker = RolloutWorker(cfg.run_root, threads=1)
    release_engine()
    try:
        resident = worker.run(rollout(stage_uri(cfg.run_root, 1, "rollout")))
        engine = ENGINE_CACHE.peek()
        fake = engine.llm if kind == "vllm" else engine.engine
        staged = run_stage(rollout(str(tmp_path / "stage-mode-rollout")))  # stage mode: the same cached engine
        assert ENGINE_CACHE.peek() is engine
    finally:
        release_engine()
    assert not any(e[0] in ("update_weights_from_disk", "update_weights_from_tensor") or e[1:2] == ("rft_reload_weights",)
                   for e in fake.events)  # served as built: no reload, no sync
    assert worker.syncs == [] and ray.lookups  # the policy gang was looked for and is not running
    got, want = (read_shard(r.uri, stage="rollout").to_pydict() for r in (resident, staged))
    assert len(got["sample_id"]) == 4 and got["response_token_ids"] == want["response_token_ids"]
    assert got["rollout_logprobs"] == want["rollout_logprobs"]


def test_resident_rollout_worker_syncs_its_vllm_engine_from_the_policy_actor(tiny_model, tok, tmp_path):
    """The real pieces around the engine: the policy worker is a Ray actor holding the trainer of
    a committed update (run there by ``run_resident``) trained on rewards that vary (so its
    weights moved: non-zero advantages and a policy loss, asserted first); the vLLM engine starts
    from another model of the same architecture. The rollout worker's ``engine_policy`` asks the
    actor for the plan in the engine's dtype, and the actor broadcasts over gloo into the two
    tensor-parallel workers of the vLLM engine. The engine then holds the update's weights (cast
    to bfloat16), every tensor of them, once: asking again moves nothing."""
    pytest.importorskip("ray")
    from rft_core.config import WorkersConfig
    from rft_core.stages.runner import run_stage
    from rft_core.workers.pool import run_resident, stop_workers
    from rft_core.stages.sources import version_key
    from rft_core.workers.rollout import RolloutWorker
    from tests.drive import drive
    from tests.tiny import build_tiny_model
    from tests.varying import assert_advantages_vary, assert_update_signal, assert_weights_moved, varying_config

    root = tmp_path / "run"
    # the update in a policy worker, the other stages here: its weights written by the update itself
    # (in the background, the worker's writer would commit them after this check)
    cfg = varying_config(tiny_model, root, "iterations=1", "checkpoint.async_weights=false")
    workers = WorkersConfig(pool=str(root), threads=1)
    other = build_tiny_model(tmp_path / "other", seed=1)  # the engine's start: neither the initial nor the trained weights
    try:
        ref1 = drive(cfg, lambda inp: run_resident(inp, workers) if inp.program == "ppo_update" else run_stage(inp))
        assert_advantages_vary(root, 1)
        assert_update_signal(ref1)
        assert_weights_moved(root, 1, tiny_model)
        engine, llm = _vllm(other, tok, 2)
        want = {k: v for k, v in load_causal_lm(f"{ref1.uri}/policy").state_dict().items() if k != "lm_head.weight"}
        assert not _holds(_shards(llm), want)
        rollout = RolloutWorker(workers.pool)
        rollout.engine_policy(engine, ref1)
        rollout.engine_policy(engine, ref1)
    finally:
        stop_workers(workers.pool)
    assert _holds(_shards(llm), want)
    assert engine.weights_version == version_key(ref1)
    assert [s["engine"] for s in rollout.syncs] == ["VLLMEngine"] and rollout.syncs[0]["backend"] == "gloo"


def test_digest_methods_follow_the_transport_and_refuse_out_of_order_tensors():
    from rft_core.weightsync.digest import Digest, sync_method

    assert [sync_method(b) for b in ("gloo", "local", "shm", "nccl", "cuda_ipc")] == ["xxh3", "xxh3", "xxh3", "device",
                                                                                    "device"]
    t = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    layout = [(k, t[k].dtype, tuple(t[k].shape)) for k in sorted(t)]
    c = Digest(layout, "xxh3")
    with pytest.raises(ValueError, match="'b' added where the layout has 'a' next"):
        c.add("b", t["b"])
    with pytest.raises(ValueError, match="unknown digest method 'md5'"):
        Digest(layout, "md5")
    flipped = t["a"].clone()
    flipped.view(torch.int32)[3] ^= 1
    assert weights_digest({**t, "a": flipped}, "xxh3") != weights_digest(t, "xxh3")


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_resident_lora_run_serves_each_versions_adapters_on_its_engine_as_stage_mode_does(kind, tiny_model, tmp_path,
                                                                                           monkeypatch):
    """A LoRA run on a vLLM or SGLang engine (the stand-ins; ``import vllm`` / ``import sglang``
    find them, so the project's own builders pass them their arguments): stage mode's engine
    serves each update's adapter checkpoint on the base (``LoRARequest``, ``load_lora_adapter``).
    Under resident workers the engine is built with LoRA on the base from iteration 1 on (its
    initial policy served without an adapter), and each version's float32 adapters move alone
    from the trainer, 16384 bytes (2 layers x rank 4 x 512 in+out features x 4 bytes), into host
    tensors that become an adapter folder the engine serves (``RolloutWorker._engine_adapters``;
    the trainer keeps its versions in memory: weights written in the background). Every rollout,
    log-prob and update shard of 3 iterations equals stage mode's, and the folder served last
    holds the adapter committed for that version, tensor for tensor."""
    from safetensors.torch import load_file

    from rft_core.engines import release_engine
    from rft_core.stages.runner import run_stage
    from rft_core.stages.writer import wait_for_optimizer_writes
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.rollout import RolloutWorker
    from schemas import read_manifest, stage_uri
    from tests.drive import drive
    from tests.varying import assert_training_signal, varying_config

    (vllm_standin if kind == "vllm" else sglang_standin).install(monkeypatch)
    lora = ["update.lora.rank=4", "update.lora.alpha=8", f"rollout.engine={kind}", "kl.kl_coef=0"]
    cfg = varying_config(tiny_model, tmp_path / "stage", *lora, iterations=3)
    release_engine()
    try:
        drive(cfg)
    finally:
        release_engine()
    assert_training_signal(cfg.run_root, (1, 2, 3))
    res = varying_config(tiny_model, tmp_path / "resident", *lora, "orchestration.workers=resident", iterations=3)
    assert res.runner("rollout").workers.lora == res.update.lora
    policy = PolicyWorker("test")
    rollout = RolloutWorker("test", peer=policy, lora=res.update.lora)
    served = []
    try:
        drive(res, lambda inp: policy.run(inp) if inp.program == "ppo_update" else
                      rollout.run(inp) if inp.program in ("rollout", "actor_logprobs") else run_stage(inp))
        engine = ENGINE_CACHE.peek()
        served = load_file(f"{rollout._served}/adapter_model.safetensors")
        wait_for_optimizer_writes()
    finally:
        release_engine()
        rollout.close()
    assert engine.lora is True if kind == "vllm" else engine._lora is True
    engine_syncs = [s for s in rollout.syncs if s.get("engine")]
    assert [s["bytes"] for s in engine_syncs] == [16384, 16384]  # versions 1 and 2, for the rollouts of 2 and 3
    # version 2, served by iteration 3's rollout: its weights written in the background (ppo_update-policy)
    stored = load_file(f"{stage_uri(res.run_root, 2, 'ppo_update-policy')}/policy/adapter_model.safetensors")
    assert served.keys() == stored.keys() and all(torch.equal(served[k], stored[k]) for k in stored)
    assert max(v.abs().max().item() for k, v in served.items() if "lora_B" in k) > 1e-4  # the adapters moved from 0
    for it in (1, 2, 3):
        for stage in ("rollout", "actor_logprobs", "advantages", "ppo_update"):
            a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg, res))
            parts = lambda m: {e.path: e.checksum for e in m.files if e.path.endswith(".parquet")}  # noqa: E731
            assert parts(a) == parts(b), (it, stage)



def test_a_lora_engines_adapters_land_on_the_workers_device(tiny_model, monkeypatch):
    """The tensors a LoRA engine's adapters land in are on the worker's device
    (``default_device``, made ``meta`` here to see it): a trainer on a GPU sends over CUDA IPC or
    NCCL, which take CUDA tensors only (a landing on the CPU was refused there: "give the receiving
    role a GPU"). One float32 tensor per adapter of the run's ``update.lora`` on the base: 28 of
    them, 16384 bytes for the tiny model at rank 4; new ones per sync, from a shell made once per
    base."""
    from rft_core.config import LoraConfig
    from rft_core.workers import rollout as rollout_module
    from rft_core.workers.rollout import RolloutWorker

    monkeypatch.setattr(rollout_module, "default_device", lambda: torch.device("meta"))
    worker = RolloutWorker("pool", lora=LoraConfig(rank=4, alpha=8.0))
    target = worker._adapter_target(tiny_model)
    assert len(target) == 28 and {(t.device.type, t.dtype) for t in target.values()} == {("meta", torch.float32)}
    assert sum(t.numel() * 4 for t in target.values()) == 16384 and all(".lora_" in n for n in target)
    shell = worker._shell[1]
    again = worker._adapter_target(tiny_model)
    assert again is not target and again.keys() == target.keys() and worker._shell[1] is shell
