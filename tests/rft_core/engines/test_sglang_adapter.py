"""The SGLang engine adapter against the engine interface, with the SGLang stand-in of
``tests/standins/sglang.py`` (SGLang 0.5.23; generation through the HF engine on the weights its
schedulers hold) for ``sglang.Engine`` (no GPU here): requests (one per sample, all in one call,
a seed each), output conversion (EOS cut, finish reasons, log-probs), refusals (FIRE, aborts,
missing log-probs, pre-temperature log-probs), engine arguments, LoRA adapters, the engine cache
with weights reloaded from disk in place and memory released between rollouts."""
from __future__ import annotations

import logging

import pytest
import torch

from rft_core.engines import SGLANG_SEED_BITS, sample_seed
from rft_core.engines import sglang as sglang_module
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine, get_sglang_engine, release_sglang_engine
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs
from tests.rft_core.engines.fakes import HFBackedSGLang, lora_adapter

PROMPTS = [[1, 20, 30, 31, 32], [1, 40], [7], [1, 50, 51]]


def _engine(parts, *, deterministic=True, **kw):
    model, tok = parts
    fake = HFBackedSGLang(model, tok, enable_deterministic_inference=deterministic, **kw)
    return SGLangEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, engine=fake, deterministic=deterministic), fake


@pytest.fixture
def fake_sglang(parts, monkeypatch):
    """build_engine replaced by a recorder returning an HFBackedSGLang on a fresh copy of the model."""
    model, tok = parts
    built: list[dict] = []

    def build(**kwargs):
        built.append(kwargs)
        fresh = type(model)(model.config)
        fresh.load_state_dict(model.state_dict())
        return HFBackedSGLang(fresh.eval(), tok, **kwargs)

    monkeypatch.setattr(sglang_module, "build_engine", build)
    return built


def test_outputs_follow_the_engine_contract(parts):
    eng, fake = _engine(parts)
    gens = eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5, temperature=0.8, top_p=1.0, batch_size=6,
                        seed=10)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(4) for k in range(3)]
    assert len(fake.calls) == 1  # every sample in one call
    input_ids, params, lora = fake.calls[0]
    order = [2, 1, 3, 0]  # prompts sorted by length, each repeated n times
    assert input_ids == [PROMPTS[p] for p in order for _ in range(3)] and lora is None
    assert [sp["sampling_seed"] for sp in params] == [sample_seed(10, p, k, 3, bits=SGLANG_SEED_BITS)
                                                      for p in order for k in range(3)]
    assert len({sp["sampling_seed"] for sp in params}) == 12
    assert all(sp["max_new_tokens"] == 5 and sp["temperature"] == 0.8 for sp in params)
    model, tok = parts
    want = batched_response_logprobs(model, [PROMPTS[g.prompt_index] for g in gens], [g.response_token_ids for g in gens],
                                     pad_token_id=tok.pad_token_id, temperature=0.8)
    for g, lp in zip(gens, want):
        assert g.finish_reason in ("stop", "length") and len(g.logprobs) == len(g.response_token_ids) > 0
        assert g.logprobs == pytest.approx(lp, abs=1e-4)
    # same seed, same samples; shards of batches together give the whole
    assert [g.response_token_ids for g in eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5,
                                                       temperature=0.8, batch_size=6, seed=10)] == \
        [g.response_token_ids for g in gens]
    halves = [eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5, temperature=0.8, batch_size=6, seed=10,
                           only_batches={i}) for i in range(2)]
    assert sorted(halves[0] + halves[1], key=lambda g: (g.prompt_index, g.sample_index)) == gens


def test_eos_cut_finish_reasons_and_refusals(parts, monkeypatch):
    eos = next(iter(HFEngine(*parts).eos_ids))
    eng, _ = _engine(parts, eos_early=eos)
    g = eng.generate(PROMPTS[:1], n_samples_per_prompt=2, max_new_tokens=5, seed=0)[0]
    assert g.response_token_ids[-1] == eos and len(g.response_token_ids) == len(g.logprobs) == 3
    assert g.finish_reason == "stop"
    with pytest.raises(NotImplementedError, match="FIRE"):
        eng.generate(PROMPTS, n_samples_per_prompt=1, max_new_tokens=2, first_token_temperature=2.0)
    out = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}
    with pytest.raises(RuntimeError, match="aborted sample 1 of prompt 2: out of memory"):
        eng._generation(2, 1, out)
    out = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2},
                                               "output_token_logprobs": [(-1.0, 5, None)]}}
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        eng._generation(0, 0, out)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "True")
    with pytest.raises(ValueError, match="before temperature"):
        _engine(parts)


def test_without_deterministic_inference_no_seed_is_sent(parts, caplog):
    with caplog.at_level(logging.WARNING, logger="rft_core.engines.sglang"):
        eng, fake = _engine(parts, deterministic=False)
    assert "not reproducible" in caplog.text
    eng.generate(PROMPTS[:2], n_samples_per_prompt=2, max_new_tokens=2)
    assert all("sampling_seed" not in sp for sp in fake.calls[0][1])


def test_engine_arguments(tiny_model, fake_sglang, tmp_path):
    eng = SGLangEngine(tiny_model, eos_ids={2}, tensor_parallel_size=2, mem_fraction_static=0.3, dtype="float32",
                       max_model_len=512, enable_memory_saver=True)
    assert fake_sglang[-1] == {"model_path": tiny_model, "tp_size": 2, "mem_fraction_static": 0.3, "dtype": "float16",
                               "skip_tokenizer_init": True, "enable_memory_saver": True,
                               "enable_deterministic_inference": True, "context_length": 512}
    eng.close()
    assert eng.engine is None


def test_lora_adapters_are_loaded_by_name_and_replaced(parts, tiny_model, tmp_path, fake_sglang):
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    a1, a2 = lora_adapter(tiny_model, tmp_path / "a1", 1), lora_adapter(tiny_model, tmp_path / "a2", 2)
    eng = get_sglang_engine(tiny_model, eos_ids=eos, lora_path=a1, max_lora_rank=8)
    assert fake_sglang[-1]["enable_lora"] is True and fake_sglang[-1]["max_lora_rank"] == 8
    assert fake_sglang[-1]["lora_target_modules"] == ["all"]
    eng.generate(PROMPTS[:2], n_samples_per_prompt=2, max_new_tokens=2)
    assert get_sglang_engine(tiny_model, eos_ids=eos, lora_path=a2, max_lora_rank=8) is eng and len(fake_sglang) == 1
    eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    fake = eng.engine
    assert [c[2] for c in fake.calls] == [["policy-1"] * 4, ["policy-2"]]
    assert [e for e in fake.events if "lora" in e[0]] == [("load_lora_adapter", "policy-1", a1),
                                                          ("unload_lora_adapter", "policy-1"),
                                                          ("load_lora_adapter", "policy-2", a2)]
    with pytest.raises(ValueError, match="built with LoRA"):
        eng.load_policy(str(tmp_path / "another-full-checkpoint"))
    eng.load_policy(tiny_model)  # its base itself: served without an adapter (a LoRA run's initial policy)
    eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert fake.calls[-1][2] is None and ("unload_lora_adapter", "policy-2") in fake.events[-3:]


def test_a_lora_engine_built_for_a_resident_run_keeps_its_synced_adapter_through_a_release(parts, tiny_model, tmp_path,
                                                                                         fake_sglang):
    """``enable_lora`` without an adapter (a resident LoRA run's engine): the base is served with
    no adapter name; an adapter folder given with the ``version`` a sync landed is loaded under a
    name and recorded as ``weights_version``; releasing the memory keeps that version (the base
    reloads from disk and the adapter from its folder at the next ``generate``)."""
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    a1 = lora_adapter(tiny_model, tmp_path / "a1", 1)
    eng = get_sglang_engine(tiny_model, eos_ids=eos, enable_lora=True, max_lora_rank=8, enable_memory_saver=True)
    assert fake_sglang[-1]["enable_lora"] is True
    eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    eng.load_policy(tiny_model, a1, version="v1")
    eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    assert eng.weights_version == "v1" and ("release_memory_occupation",) in eng.engine.events
    eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
    fake = eng.engine
    assert [c[2] for c in fake.calls] == [None, ["policy-1"], ["policy-2"]]  # reloaded under a new name after a release
    assert [e for e in fake.events if "lora" in e[0]][-1] == ("load_lora_adapter", "policy-2", a1)
    assert eng.weights_version == "v1"


def _perturbed_checkpoint(tiny_model, out, seed=0):
    model = load_causal_lm(tiny_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return str(out), model


def test_cached_engine_reloads_from_disk_and_releases_memory(parts, tiny_model, tmp_path, fake_sglang):
    model, tok = parts
    eos = HFEngine(model, tok).eos_ids
    eng = get_sglang_engine(tiny_model, eos_ids=eos, enable_memory_saver=True)
    eng.generate(PROMPTS[:2], n_samples_per_prompt=1, max_new_tokens=2)
    assert eng.engine.events == [("generate", 2), ("release_memory_occupation",)]
    new_path, new_model = _perturbed_checkpoint(tiny_model, tmp_path / "iter2")
    assert get_sglang_engine(new_path, eos_ids=eos, enable_memory_saver=True) is eng and len(fake_sglang) == 1
    gens = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=4, seed=3)
    assert eng.engine.events[2:] == [("resume_memory_occupation",), ("update_weights_from_disk", new_path),
                                     ("flush_cache",), ("generate", 8), ("release_memory_occupation",)]
    want = batched_response_logprobs(new_model, [PROMPTS[g.prompt_index] for g in gens],
                                     [g.response_token_ids for g in gens], pad_token_id=tok.pad_token_id)
    for g, lp in zip(gens, want):
        assert g.logprobs == pytest.approx(lp, abs=1e-4)
    fake = eng.engine
    assert release_sglang_engine() is True and fake.events[-1] == ("shutdown",) and release_sglang_engine() is False


def test_a_failed_weight_update_is_an_error(parts):
    eng, _ = _engine(parts, fail_update=True)
    eng.load_policy("/ckpt/iter9")
    with pytest.raises(RuntimeError, match=r"SGLang update_weights_from_disk\(/ckpt/iter9\) failed: "):
        eng.generate(PROMPTS[:1], n_samples_per_prompt=1, max_new_tokens=2)
