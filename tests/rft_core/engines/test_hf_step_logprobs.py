"""The HF engine scores each sampled token as it is generated (``StepLogprobs``) instead of
keeping every step's logits: hand-computed scores, one step kept at a time, the count check,
``generate`` asked for no logits, and the log-probs still equal the actor's teacher-forced pass."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rft_core.engines.hf import HFEngine, StepLogprobs
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs


def _out(rows):
    """A forward output whose last position holds ``rows`` (B, V)."""
    return SimpleNamespace(logits=torch.tensor(rows, dtype=torch.float32)[:, None, :])


def test_scores_each_token_from_the_previous_forward():
    rec = StepLogprobs(temperature=0.5)
    # prefill: logits (log 1, log 3) for row 0 and (0, 0) for row 1; 2 rows of a batch
    rec(None, (), {"input_ids": torch.tensor([[4, 5], [6, 7]])}, _out([[0.0, math.log(3.0)], [0.0, 0.0]]))
    assert rec.steps == [] and rec.pending is not None
    # decode: the input is the sampled token (1 for row 0, 0 for row 1)
    rec(None, (), {"input_ids": torch.tensor([[1], [0]])}, _out([[2.0, 0.0], [0.0, 0.0]]))
    lps = rec.result(torch.tensor([[1, 0], [0, 1]]))
    # step 1 at T=0.5: p ∝ (1, 9) -> log 0.9 for token 1; (1, 1) -> log 0.5
    # step 2: logits (2, 0)/0.5 = (4, 0): token 0 -> -log(1 + e^-4); row 1 uniform -> log 0.5
    want = torch.tensor([[math.log(0.9), -math.log(1 + math.exp(-4.0))], [math.log(0.5), math.log(0.5)]])
    torch.testing.assert_close(lps, want, atol=1e-6, rtol=0)
    assert len(rec.steps) == 1  # one (B,) score per scored step, nothing (B, V) kept but the pending row
    with pytest.raises(RuntimeError, match="2 forward passes for 3 generated tokens"):
        rec.result(torch.zeros(2, 3, dtype=torch.long))


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(load_causal_lm(tiny_model), load_tokenizer(tiny_model))


def test_generate_keeps_no_logits_and_matches_the_actor_pass(engine, monkeypatch):
    seen = []
    generate = engine.model.generate

    def recording(**kwargs):
        out = generate(**kwargs)
        seen.append((kwargs.get("output_logits"), getattr(out, "logits", None)))
        return out

    monkeypatch.setattr(engine.model, "generate", recording)
    prompts = [[1, 20, 30], [1, 40], [7, 8, 9, 10]]
    gens = engine.generate(prompts, n_samples_per_prompt=2, max_new_tokens=7, temperature=0.7, batch_size=4, seed=4)
    assert seen == []  # a text model decodes in HFEngine._decode (finished rows dropped), not through generate
    want = batched_response_logprobs(engine.model, [prompts[g.prompt_index] for g in gens],
                                     [g.response_token_ids for g in gens], pad_token_id=engine.pad_token_id,
                                     temperature=0.7)
    for g, lp in zip(gens, want):
        assert len(g.logprobs) == len(g.response_token_ids) > 0
        assert g.logprobs == pytest.approx(lp, abs=1e-4)
    assert not engine.model._forward_hooks  # the recorder is removed after each batch


def test_rows_that_finish_leave_the_batch_and_the_others_decode_as_generate_does(engine, monkeypatch):
    """Greedy decoding of left-padded rows: every row's tokens equal transformers' own
    ``generate`` of that prompt alone; then, with a token of row 0's third step made an EOS, row 0
    stops there and leaves the batch while the other rows keep their tokens and log-probs."""
    prompts = [[1, 20, 30], [1, 40], [7, 8, 9, 10, 11]]
    free = engine.generate(prompts, n_samples_per_prompt=2, max_new_tokens=8, batch_size=6, greedy=True)
    for g in free:
        ids = torch.tensor([prompts[g.prompt_index]])
        ref = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                    eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.pad_token_id)
        assert g.response_token_ids == ref[0, ids.shape[1]:].tolist()
    stop = free[0].response_token_ids[2]
    monkeypatch.setattr(engine, "eos_ids", engine.eos_ids | {stop})
    gens = engine.generate(prompts, n_samples_per_prompt=2, max_new_tokens=8, batch_size=6, greedy=True)
    lengths = []
    for g, f in zip(gens, free):
        toks = f.response_token_ids
        cut = next((j + 1 for j, t in enumerate(toks) if t in engine.eos_ids), len(toks))
        assert g.response_token_ids == toks[:cut]
        assert g.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-5)
        assert g.finish_reason == ("stop" if toks[cut - 1] in engine.eos_ids else "length")
        lengths.append(cut)
    assert lengths[0] <= 3 and max(lengths) == 8  # row 0 left early, another row ran to the end


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(engine):
    """transformers 5.x renamed the forward's ``past_key_values`` to ``cache`` (the old name
    deprecated, removed in 5.40): the engine's decode loop passes and reads the cache under the
    name the model's forward takes, so it raises no deprecation warning now and keeps working
    after 5.40; a forward that still takes ``past_key_values`` (an older transformers) gets that
    name, and a peft wrapper is read through its base model."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from rft_core.engines.hf import cache_keyword

    class Older(torch.nn.Module):  # the signature of transformers 4.x's LlamaForCausalLM.forward, abridged
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(Older()) == "past_key_values"
    name = cache_keyword(engine.model)
    assert name == engine.cache_name == "cache"  # the pinned transformers (5.24) takes `cache`
    seen: list[set[str]] = []
    hook = engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(set(kw)), with_kwargs=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gens = engine.generate([[1, 20, 30], [1, 40]], n_samples_per_prompt=2, max_new_tokens=5, temperature=0.7,
                                   batch_size=4, seed=1)
    finally:
        hook.remove()
    assert all(len(g.response_token_ids) > 0 for g in gens) and len(seen) > 2
    assert all("past_key_values" not in kw for kw in seen) and sum("cache" in kw for kw in seen) >= len(seen) - 1
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    lora = get_peft_model(type(engine.model)(engine.model.config), LoraConfig(target_modules=["q_proj"], r=2))
    assert cache_keyword(lora) == name  # a fresh model of the same config: peft wraps it in place
