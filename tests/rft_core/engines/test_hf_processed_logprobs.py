"""The HF engine records each token's log-prob under the processed distribution it was sampled
from (that step's temperature, the top-p nucleus, renormalised), as vLLM's processed_logprobs:
hand-made distributions through the recorder, and the engine against a float64 reference built
from the actor pass's logits (top-p; FIRE's first token at its own temperature)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rft_core.engines.hf import HFEngine, StepLogprobs, processed_scores, sample_inverse_cdf
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs


def _out(rows):
    return SimpleNamespace(logits=torch.tensor(rows, dtype=torch.float32)[:, None, :])


def test_top_p_point_eight_hand_made_distribution():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    # smallest set of mass >= 0.8: {0.5, 0.25} has 0.75, so 0.15 joins; kept mass 0.9
    T = 0.5
    logits = (np.log(p) * T).tolist()  # at temperature 0.5 softmax(logits / T) = p
    rec = StepLogprobs(T, top_p=0.8)
    rec(None, (), {"input_ids": torch.tensor([[3, 4], [3, 4]])}, _out([logits, logits]))
    rec(None, (), {"input_ids": torch.tensor([[1], [2]])}, _out([logits, logits]))  # step 0 drew 1 and 2
    lps = rec.result(torch.tensor([[1, 0], [2, 3]]))
    assert lps[0].tolist() == pytest.approx([math.log(0.25 / 0.9), math.log(0.5 / 0.9)], abs=1e-6)
    assert lps[1, 0].item() == pytest.approx(math.log(0.15 / 0.9), abs=1e-6)
    assert lps[1, 1].item() == -math.inf  # 0.1 lies outside the nucleus: the sampler cannot draw it
    x = processed_scores(torch.tensor([logits]), temperature=T, top_p=0.8)
    assert torch.isinf(x[0, 3]) and torch.softmax(x, -1)[0, :3].tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9])


def test_fire_first_step_uses_its_own_temperature():
    logits = [0.0, math.log(3.0)]
    rec = StepLogprobs(0.5, first_token_temperature=2.0)
    rec(None, (), {"input_ids": torch.tensor([[7]])}, _out([logits]))
    rec(None, (), {"input_ids": torch.tensor([[1]])}, _out([logits]))
    lps = rec.result(torch.tensor([[1, 1]]))
    # step 0 at T=2: p ∝ (1, sqrt 3) -> sqrt3 / (1 + sqrt3); step 1 at T=0.5: p ∝ (1, 9) -> 0.9
    want = [math.log(math.sqrt(3) / (1 + math.sqrt(3))), math.log(0.9)]
    assert lps[0].tolist() == pytest.approx(want, abs=1e-6)


def _nucleus_logprob(logits: np.ndarray, token: int, temperature: float, top_p: float) -> float:
    """float64 reference: log p(token) under softmax(logits / T) restricted to the smallest set
    of most probable tokens whose mass reaches top_p, renormalised."""
    x = logits.astype(np.float64) / temperature
    logp = x - np.logaddexp.reduce(x)
    order = np.argsort(-logp, kind="stable")
    mass = np.cumsum(np.exp(logp[order]))
    n_keep = int(np.searchsorted(mass, top_p - 1e-12)) + 1
    kept = order[:n_keep]
    assert token in set(kept.tolist()), "token outside the reference nucleus"
    return float(logp[token] - np.logaddexp.reduce(logp[kept]))


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(load_causal_lm(tiny_model), load_tokenizer(tiny_model))


def _teacher_forced_logits(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """(len(response), V) float64 logits that predict each response token, one full forward."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt + response])).logits[0].double().numpy()
    return out[len(prompt) - 1: len(prompt) + len(response) - 1]


@pytest.mark.parametrize("fire", [None, 3.0])
def test_engine_records_the_nucleus_logprob(engine, fire):
    prompts = [[1, 20, 30], [1, 40]]
    # a near-uniform random model: sharpen it (T=0.05) so that top-p 0.8 keeps a real subset
    T, top_p = 0.05, 0.8
    gens = engine.generate(prompts, n_samples_per_prompt=3, max_new_tokens=5, temperature=T, top_p=top_p, batch_size=6,
                           seed=11, first_token_temperature=fire)
    checked = 0
    for g in gens:
        logits = _teacher_forced_logits(engine.model, prompts[g.prompt_index], g.response_token_ids)
        for j, (tok, lp) in enumerate(zip(g.response_token_ids, g.logprobs)):
            step_t = fire if (fire is not None and j == 0) else T
            want = _nucleus_logprob(logits[j], tok, step_t, top_p)
            plain = float((logits[j] / step_t - np.logaddexp.reduce(logits[j] / step_t))[tok])
            assert lp == pytest.approx(want, abs=2e-3), (g.prompt_index, g.sample_index, j)
            assert lp >= plain - 1e-4  # renormalised over the nucleus: never below the full softmax's
            checked += 1
    assert checked >= 20
    # the nucleus really truncated something: some token's log-prob rose above the full softmax's
    diffs = []
    for g in gens:
        logits = _teacher_forced_logits(engine.model, prompts[g.prompt_index], g.response_token_ids)
        x = logits[-1] / T
        diffs.append(g.logprobs[-1] - float((x - np.logaddexp.reduce(x))[g.response_token_ids[-1]]))
    assert max(diffs) > 1e-3
    # the truncated-IS ratio the update sees, pi_old / pi_rollout with pi_old from the actor pass, is
    # the nucleus mass of each step's sampling distribution (<= 1; FIRE's first token: another ratio)
    actor = batched_response_logprobs(engine.model, [prompts[g.prompt_index] for g in gens],
                                      [g.response_token_ids for g in gens], pad_token_id=engine.pad_token_id,
                                      temperature=T)
    for g, old in zip(gens, actor):
        logits = _teacher_forced_logits(engine.model, prompts[g.prompt_index], g.response_token_ids)
        for j, tok in enumerate(g.response_token_ids):
            if fire is not None and j == 0:
                continue
            x = logits[j] / T
            logp = x - np.logaddexp.reduce(x)
            mass = float(np.exp(logp[tok] - _nucleus_logprob(logits[j], tok, T, top_p)))
            assert math.exp(old[j] - g.logprobs[j]) == pytest.approx(mass, rel=2e-3) and mass <= 1.0 + 1e-9


def test_the_model_generation_config_does_not_change_what_is_sampled(engine, monkeypatch):
    """A checkpoint's generation_config.json with top_k 1 and a repetition penalty (common in
    instruct releases) would make generate greedy and penalised; the engine neutralises them, so
    the samples come from the distribution the log-probs describe."""
    monkeypatch.setattr(engine.model.generation_config, "top_k", 1)
    monkeypatch.setattr(engine.model.generation_config, "repetition_penalty", 1.5)
    gens = engine.generate([[1, 20, 30]], n_samples_per_prompt=8, max_new_tokens=3, temperature=1.0, batch_size=8, seed=0)
    assert len({tuple(g.response_token_ids) for g in gens}) >= 6  # ~49k near-uniform tokens: not greedy
    want = batched_response_logprobs(engine.model, [[1, 20, 30]] * 8, [g.response_token_ids for g in gens],
                                     pad_token_id=engine.pad_token_id)
    for g, lp in zip(gens, want):
        assert g.logprobs == pytest.approx(lp, abs=1e-4)


def test_inverse_cdf_draws_each_row_from_its_distribution():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float32) * 0.999  # rows need not sum to exactly 1
    n = 200_000
    draws = sample_inverse_cdf(p.expand(n, 4))
    assert draws.shape == (n,) and draws.dtype == torch.int64
    counts = torch.bincount(draws, minlength=4).double()
    want = p.double() / p.double().sum() * n
    assert counts[1] == 0  # an empty interval is never drawn
    sigma = (want * (1 - want / n)).sqrt()
    assert ((counts - want).abs() <= 5 * sigma + 1e-9).all(), (counts, want)
    one_hot = sample_inverse_cdf(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    assert one_hot.tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"probs must be \(B, V\)"):
        sample_inverse_cdf(p)


@pytest.mark.parametrize("fire", [None, 3.0])
def test_engine_samples_the_first_token_from_its_processed_distribution(engine, fire):
    """2000 first tokens of one prompt against softmax(logits / T_0) (T_0: FIRE's first-token
    temperature when given): the vocabulary sorted by probability and cut into 10 bins of equal
    mass, Pearson's chi-square of the bin counts below 33.7 (9 degrees of freedom, p = 1e-4)."""
    prompt, T, n = [1, 20, 30], 0.05, 2000
    gens = engine.generate([prompt], n_samples_per_prompt=n, max_new_tokens=1, temperature=T, batch_size=500, seed=3,
                           first_token_temperature=fire)
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / (fire or T), dim=-1)
    order = torch.argsort(probs, descending=True)
    bin_of = torch.empty_like(order)
    bin_of[order] = (torch.cumsum(probs[order], 0) * 10).clamp(max=9.999).long()  # 10 bins of ~0.1 mass each
    want = torch.zeros(10, dtype=torch.float64).index_add_(0, bin_of, probs) * n
    got = torch.bincount(bin_of[torch.tensor([g.response_token_ids[0] for g in gens])], minlength=10).double()
    assert want.min() > 50  # every bin has mass to test
    assert float(((got - want) ** 2 / want).sum()) < 33.7, (got, want)
