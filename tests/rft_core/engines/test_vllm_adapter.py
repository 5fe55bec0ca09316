"""The vLLM engine adapter against the engine interface, with the vLLM stand-in of
``tests/standins/vllm.py`` (vLLM 0.33.0's workers, executor and sleep mode; generation through
the HF engine on the weights the workers hold) for ``vllm.LLM`` (no GPU here): one generate call
for all prompts, one seed per sample (distinct over realistic rollouts), output conversion (EOS
cut, finish reasons, log-probs), shards, FIRE refusal, the engine dtype, the process-level engine
cache (weights reloaded in place through the worker extension, sleep/wake, release) and LoRA
requests."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rft_core.config import load_config
from rft_core.engines import ENGINE_CACHE, VLLM_SEED_BITS, engine_dtype, sample_seed
from rft_core.engines import vllm as vllm_module
from rft_core.engines.hf import HFEngine
from rft_core.engines.vllm import VLLMEngine, WeightReloadExtension, get_vllm_engine, release_vllm_engine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs
from tests.rft_core.engines.fakes import HFBackedLLM, SamplingParams, lora_adapter
from tests.standins import vllm as vllm_standin

PROMPTS = [[1, 20, 30, 31, 32], [1, 40], [7], [1, 50, 51]]


@pytest.fixture
def fake_vllm(parts, monkeypatch):
    """build_llm replaced by a recorder returning an HFBackedLLM on a fresh copy of the tiny model."""
    model, tok = parts
    built: list[dict] = []

    def build(**kwargs):
        built.append(kwargs)
        fresh = type(model)(model.config)
        fresh.load_state_dict(model.state_dict())
        return HFBackedLLM(fresh.eval(), tok, **kwargs)

    vllm_standin.install(monkeypatch)  # vllm.SamplingParams and vllm.lora.request.LoRARequest: the stand-in's
    monkeypatch.setattr(vllm_module, "build_llm", build)
    return built


def _engine(parts, **kw):
    model, tok = parts
    llm = HFBackedLLM(model, tok, **kw)
    return VLLMEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, llm=llm, sampling_params=SamplingParams), llm


def _teacher_forced(model, tok, prompts, gens, temperature=1.0):
    return batched_response_logprobs(model, [prompts[g.prompt_index] for g in gens], [g.response_token_ids for g in gens],
                                     pad_token_id=tok.pad_token_id, temperature=temperature)


def test_outputs_follow_the_engine_contract(parts):
    eng, llm = _engine(parts)
    gens = eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5, temperature=0.8, batch_size=6, seed=10)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(4) for k in range(3)]
    # one call holds every prompt (vLLM schedules), sorted by length; a seed per sample
    assert len(llm.calls) == 1
    requests, params, _ = llm.calls[0]
    assert [r["prompt_token_ids"] for r in requests] == [[7], [1, 40], [1, 50, 51], [1, 20, 30, 31, 32]]
    assert [sp.seed for sp in params] == [sample_seed(10, p, 0, 3, bits=VLLM_SEED_BITS) for p in (2, 1, 3, 0)]
    assert len(set(llm.child_seeds)) == 12 == len(llm.child_seeds)
    assert all(sp.n == 3 and sp.max_tokens == 5 and sp.temperature == 0.8 for sp in params)
    model, tok = parts
    for g, lp in zip(gens, _teacher_forced(model, tok, PROMPTS, gens, 0.8)):
        assert g.finish_reason in ("stop", "length") and len(g.logprobs) == len(g.response_token_ids)
        assert g.logprobs == pytest.approx(lp, abs=1e-4)


def test_seeds_are_distinct_over_realistic_rollouts():
    """1024 prompts x 16 samples, three iterations seeded as the rollout stage seeds them: every
    (iteration, prompt, sample) gets its own stream, with vLLM's child seeds (request seed + k)
    and SGLang's 31-bit per-sample seeds; the previous scheme (seed + prompt index, + k by vLLM)
    reused streams across neighbouring prompts."""
    from rft_core.engines import SGLANG_SEED_BITS
    from rft_core.stages.rollout import SEED_STRIDE

    P, n = 1024, 16
    vllm_seeds, sglang_seeds, old = [], [], []
    for iteration in (1, 2, 3):
        seed = 0 + SEED_STRIDE * iteration
        for p in range(P):
            parent = sample_seed(seed, p, 0, n, bits=VLLM_SEED_BITS)
            vllm_seeds += [parent + k for k in range(n)]
            sglang_seeds += [sample_seed(seed, p, k, n, bits=SGLANG_SEED_BITS) for k in range(n)]
            old += [seed + p + k for k in range(n)]
    assert len(set(vllm_seeds)) == len(vllm_seeds) == 3 * P * n
    assert len(set(sglang_seeds)) == len(sglang_seeds)
    assert max(sglang_seeds) < 2**31 and max(vllm_seeds) < 2**63
    assert len(set(old)) < len(old) / 10
    with pytest.raises(ValueError, match="sample 3 of prompt 0 with 3 samples"):
        sample_seed(0, 0, 3, 3, bits=31)


def test_response_is_cut_after_the_first_eos(parts):
    eos = next(iter(HFEngine(*parts).eos_ids))
    eng, _ = _engine(parts, eos_early=eos)
    gens = eng.generate(PROMPTS[:1], n_samples_per_prompt=2, max_new_tokens=5, seed=0)
    assert gens[0].response_token_ids[-1] == eos and len(gens[0].response_token_ids) == 3
    assert len(gens[0].logprobs) == 3 and gens[0].finish_reason == "stop"


def test_shards_union_equals_the_whole_and_fire_is_refused(parts):
    eng, llm = _engine(parts)
    kw = {"n_samples_per_prompt": 2, "max_new_tokens": 4, "batch_size": 2, "seed": 5}
    whole = eng.generate(PROMPTS, **kw)
    n_batches = len(eng.batches(PROMPTS, 2, 2))
    halves = [eng.generate(PROMPTS, only_batches={b for b in range(n_batches) if b % 2 == i}, **kw) for i in range(2)]
    assert sorted(halves[0] + halves[1], key=lambda g: (g.prompt_index, g.sample_index)) == whole
    assert [len(reqs) for reqs, _, _ in llm.calls] == [4, 2, 2]  # one call per generate
    with pytest.raises(NotImplementedError, match="FIRE"):
        eng.generate(PROMPTS, first_token_temperature=2.0, **kw)


def test_engine_dtype(monkeypatch, caplog):
    assert engine_dtype("bfloat16") == "bfloat16" and engine_dtype("float16", bf16_supported=False) == "float16"
    with caplog.at_level(logging.INFO, logger="rft_core.engines"):
        assert engine_dtype("float32", bf16_supported=True) == "bfloat16"
        assert engine_dtype("auto", bf16_supported=False) == "float16"
    assert "policy dtype float32: the rollout engine runs in bfloat16" in caplog.text
    with pytest.raises(ValueError, match="unknown policy dtype 'fp8'"):
        engine_dtype("fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert engine_dtype("float32") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert engine_dtype("auto") == "float16"


def test_make_engine_builds_vllm_with_the_mapped_dtype(tiny_model, fake_vllm):
    from rft_core.stages.rollout import make_engine

    cfg = load_config(None, {"rollout.engine": "vllm", "rollout.vllm": {"gpu_memory_utilization": 0.3}}).rollout
    engine, _ = make_engine(cfg, tiny_model, dtype="float32")
    built = fake_vllm[-1]
    assert built["model"] == tiny_model and built["gpu_memory_utilization"] == 0.3
    assert built["logprobs_mode"] == "processed_logprobs" and "enable_lora" not in built
    assert built["dtype"] == "float16"  # float32 policy, no bfloat16 on this CPU
    assert built["worker_extension_cls"] == "rft_core.engines.vllm.WeightReloadExtension"
    gens = engine.generate(PROMPTS[:2], n_samples_per_prompt=2, max_new_tokens=3)
    assert all(len(g.logprobs) == len(g.response_token_ids) > 0 for g in gens)


def _perturbed_checkpoint(tiny_model, out, scale=0.5, seed=0):
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    load_tokenizer(tiny_model).save_pretrained(out)
    return str(out), model


def test_cached_engine_reloads_a_new_checkpoint_in_place(parts, tiny_model, tmp_path, fake_vllm):
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    settings = {"gpu_memory_utilization": 0.4, "dtype": "bfloat16"}
    first = get_vllm_engine(tiny_model, eos_ids=eos, **settings)
    first.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=3, seed=1)
    new_path, new_model = _perturbed_checkpoint(tiny_model, tmp_path / "iter2")
    again = get_vllm_engine(new_path, eos_ids=eos, **settings)
    assert again is first and len(fake_vllm) == 1  # no second LLM
    gens = again.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=4, seed=2)
    assert ("collective_rpc", "rft_reload_weights", (new_path,)) in again.llm.events
    i = again.llm.events.index(("collective_rpc", "rft_reload_weights", (new_path,)))
    assert again.llm.events[i + 1] == ("reset_prefix_cache",) and again.llm.events[i + 2][0] == "generate"
    # the samples and their log-probs are the new checkpoint's
    for g, lp in zip(gens, _teacher_forced(new_model, tok, PROMPTS, gens)):
        assert g.logprobs == pytest.approx(lp, abs=1e-4)
    # the same checkpoint again: no reload
    n_events = len(again.llm.events)
    get_vllm_engine(new_path, eos_ids=eos, **settings).generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert [e[0] for e in again.llm.events[n_events:]] == ["generate"]
    # other engine settings: the old engine is shut down, a new one built
    old_llm = again.llm
    other = get_vllm_engine(new_path, eos_ids=eos, gpu_memory_utilization=0.6, dtype="bfloat16")
    assert other is not first and len(fake_vllm) == 2 and old_llm.events[-1] == ("shutdown",)
    assert first.llm is None
    assert release_vllm_engine() is True and ENGINE_CACHE.peek() is None and release_vllm_engine() is False


def test_a_reload_no_worker_answers_fails_within_its_timeout_and_the_next_engine_is_new(parts, tiny_model, tmp_path,
                                                                                        fake_vllm):
    """A vLLM worker that never answers the in-place reload (``LLM.collective_rpc`` without a
    timeout would wait forever): the reload fails with vLLM's ``TimeoutError`` after
    ``reload_timeout_s``, the engine is closed as dead and leaves the cache, and the next
    ``get_vllm_engine`` builds a new one on the new checkpoint."""
    import threading
    import time

    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    engine = get_vllm_engine(tiny_model, eos_ids=eos, tensor_parallel_size=2)
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    engine.reload_timeout_s = 1.0
    engine.llm.workers[1].hang = threading.Event()  # never set: worker 1 never answers
    new_path, _ = _perturbed_checkpoint(tiny_model, tmp_path / "next")
    assert get_vllm_engine(new_path, eos_ids=eos, tensor_parallel_size=2) is engine
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rft_reload_weights timed out"):
        engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert 1.0 <= time.monotonic() - t0 < 10.0
    assert engine.dead and ENGINE_CACHE.peek() is None and engine.llm is None
    fresh = get_vllm_engine(new_path, eos_ids=eos, tensor_parallel_size=2)
    assert fresh is not engine and len(fake_vllm) == 2 and fake_vllm[1]["model"] == new_path  # built on it
    assert len(fresh.generate(PROMPTS, n_samples_per_prompt=1, max_new_tokens=3, seed=4)) == len(PROMPTS)


def test_sleep_mode_frees_the_gpu_between_rollouts(parts, tiny_model, tmp_path, fake_vllm):
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    engine = get_vllm_engine(tiny_model, eos_ids=eos, enable_sleep_mode=True)
    engine.generate(PROMPTS[:2], n_samples_per_prompt=1, max_new_tokens=2)
    assert engine.llm.events == [("generate", 2), ("sleep", 2)]  # full weights: discarded, reloaded next time
    new_path, _ = _perturbed_checkpoint(tiny_model, tmp_path / "next")
    get_vllm_engine(new_path, eos_ids=eos, enable_sleep_mode=True).generate(PROMPTS[:2], n_samples_per_prompt=1,
                                                                            max_new_tokens=2)
    assert engine.llm.events[2:] == [("wake_up", ("weights",)), ("collective_rpc", "rft_reload_weights", (new_path,)),
                                     ("reset_prefix_cache",), ("wake_up", ("kv_cache",)), ("generate", 2), ("sleep", 2)]
    # after a level-2 sleep even the same checkpoint is reloaded (its weights were discarded)
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert ("collective_rpc", "rft_reload_weights", (new_path,)) in engine.llm.events[8:]


def _lora(request) -> tuple:
    return request.lora_name, request.lora_int_id, request.lora_path


def test_lora_policy_is_served_as_a_vllm_lora_request(parts, tiny_model, tmp_path, fake_vllm):
    from rft_core.stages.rollout import make_engine

    adapter = lora_adapter(tiny_model, tmp_path / "policy", 0)
    cfg = load_config(None, {"rollout.engine": "vllm"}).rollout
    engine, _ = make_engine(cfg, adapter, dtype="bfloat16")
    assert fake_vllm[-1]["model"] == tiny_model and fake_vllm[-1]["enable_lora"] is True
    assert fake_vllm[-1]["dtype"] == "bfloat16"
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert _lora(engine.llm.calls[0][2]) == ("policy-1", 1, adapter)


def test_cached_lora_engine_gets_a_new_request_id_per_adapter(parts, tiny_model, tmp_path, fake_vllm):
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    a1, a2 = lora_adapter(tiny_model, tmp_path / "a1", 1), lora_adapter(tiny_model, tmp_path / "a2", 2)
    engine = get_vllm_engine(tiny_model, eos_ids=eos, lora_path=a1, enable_sleep_mode=True)
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert get_vllm_engine(tiny_model, eos_ids=eos, lora_path=a2, enable_sleep_mode=True) is engine
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert [_lora(c[2]) for c in engine.llm.calls] == [("policy-1", 1, a1), ("policy-2", 2, a2)]
    # LoRA keeps its base weights through a level-1 sleep: no reload
    assert ("sleep", 1) in engine.llm.events and not any(e[0] == "collective_rpc" for e in engine.llm.events)
    with pytest.raises(ValueError, match="built with LoRA"):
        engine.load_policy(str(tmp_path / "another-full-checkpoint"))
    with pytest.raises(ValueError, match="has base /elsewhere"):
        engine.load_policy("/elsewhere", a2)
    engine.load_policy(tiny_model)  # its base itself: served without an adapter (a LoRA run's initial policy)
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert engine.llm.calls[-1][2] is None and engine.lora_request is None


class _NewRunner:
    """``GPUModelRunner.reload_weights`` of vLLM 0.33.0 (vllm/v1/worker/gpu_model_runner.py): its signature."""

    def __init__(self):
        self.model_config = SimpleNamespace(model="/base")

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        raise AssertionError("the worker's reload_weights is called, not the runner's")


class _OldRunner(_NewRunner):
    """vLLM 0.10.x: ``reload_weights()`` re-reads ``model_config.model``."""

    def reload_weights(self):
        raise AssertionError("the worker's reload_weights is called, not the runner's")


class _Worker:
    """vLLM's GPU worker surface (vllm/v1/worker/gpu_worker.py): ``rank``, ``model_runner`` and
    ``reload_weights(*args, **kwargs)`` (which passes on to the runner's)."""

    def __init__(self, runner, fail=None):
        self.model_runner, self.rank, self.fail = runner, 0, fail
        self.calls = []

    def reload_weights(self, *args, **kwargs):
        self.calls.append((args, kwargs, self.model_runner.model_config.model))
        if self.fail:
            raise FileNotFoundError(self.fail)


class _ExtendedWorker(_Worker, WeightReloadExtension):
    """How vLLM mixes ``worker_extension_cls`` into its worker class."""


def test_a_lora_engine_built_for_a_resident_run_serves_the_base_then_synced_adapters(parts, tiny_model, tmp_path,
                                                                                     fake_vllm):
    """``enable_lora`` without an adapter (a resident LoRA run's engine): the base is served with
    no LoRA request; an adapter folder given with the ``version`` a sync landed is served under a
    new request id and recorded as ``weights_version``; a level-1 sleep (the default for a LoRA
    engine: the base kept in host memory) keeps it; the same folder again keeps its request; the
    base again drops the adapter and the version."""
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    a1 = lora_adapter(tiny_model, tmp_path / "a1", 1)
    engine = get_vllm_engine(tiny_model, eos_ids=eos, enable_lora=True, enable_sleep_mode=True)
    assert fake_vllm[-1]["enable_lora"] is True and engine.lora and engine.lora_request is None
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    engine.load_policy(tiny_model, a1, version="v1")
    assert engine.weights_version == "v1"
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert ("sleep", 1) in engine.llm.events and engine.weights_version == "v1"
    engine.load_policy(tiny_model, a1, version="v1")
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    engine.load_policy(tiny_model)
    engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert [c[2] and _lora(c[2]) for c in engine.llm.calls] == [None, ("policy-1", 1, a1), ("policy-1", 1, a1), None]
    assert engine.weights_version is None
    with pytest.raises(ValueError, match="sync needs an engine built on the full model"):
        engine.sync_world_size


def test_lora_engines_are_cached_per_base_and_full_engines_per_architecture(parts, tiny_model, tmp_path, fake_vllm):
    """A cached engine is reused for a checkpoint of the same architecture (reloaded in place),
    but a LoRA engine (``enable_lora``: a resident LoRA run's, whose base no adapter replaces)
    only for the same base: another base of the same architecture gets an engine of its own."""
    from tests.tiny import build_tiny_model

    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    other = str(build_tiny_model(tmp_path / "other", seed=1))  # the same architecture, other weights
    full = get_vllm_engine(tiny_model, eos_ids=eos)
    assert get_vllm_engine(other, eos_ids=eos) is full and len(fake_vllm) == 1
    lora = get_vllm_engine(tiny_model, eos_ids=eos, enable_lora=True)
    assert lora is not full and get_vllm_engine(tiny_model, eos_ids=eos, enable_lora=True, reload=False) is lora
    assert get_vllm_engine(other, eos_ids=eos, enable_lora=True, reload=False) is not lora and len(fake_vllm) == 3


def test_worker_extension_reloads_from_the_new_folder_on_old_and_new_vllm():
    new = _ExtendedWorker(_NewRunner())
    assert new.rft_reload_weights("/ckpt/iter2") == {"ok": True}
    assert new.calls == [((), {"weights_path": "/ckpt/iter2"}, "/base")]
    old = _ExtendedWorker(_OldRunner())
    assert old.rft_reload_weights("/ckpt/iter2") == {"ok": True}
    assert old.calls == [((), {}, "/ckpt/iter2")] and old.model_runner.model_config.model == "/ckpt/iter2"
    # a failure is answered, never raised through collective_rpc (vLLM's executor would leave the other replies queued)
    failing = _ExtendedWorker(_NewRunner(), fail="no *.safetensors in /ckpt/iter3")
    assert failing.rft_reload_weights("/ckpt/iter3") == {"ok": False, "rank": 0,
                                                         "error": "FileNotFoundError: no *.safetensors in /ckpt/iter3"}


def test_a_reload_that_fails_on_a_worker_raises_after_every_worker_answered(parts, tiny_model, tmp_path):
    """Tensor parallel 2 on the vLLM stand-in: a checkpoint folder with no weights fails both
    workers' reload; the engine reads both answers (none left queued in vLLM's executor), names
    the failed workers, and the next good checkpoint loads."""
    model, tok = parts
    llm = HFBackedLLM(model, tok, tensor_parallel_size=2)
    engine = VLLMEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, llm=llm, sampling_params=SamplingParams)
    (tmp_path / "empty").mkdir()
    engine.load_policy(str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match=r"vLLM: reloading .*empty failed on worker\(s\) \[0, 1\]: FileNotFoundError"):
        engine.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert [q.qsize() for q in llm.executor.responses] == [0, 0]
    good, new_model = _perturbed_checkpoint(tiny_model, tmp_path / "good")
    engine.load_policy(good)
    gens = engine.generate(PROMPTS[:2], n_samples_per_prompt=1, max_new_tokens=3)
    for g, lp in zip(gens, _teacher_forced(new_model, tok, PROMPTS[:2], gens)):
        assert g.logprobs == pytest.approx(lp, abs=1e-4)
