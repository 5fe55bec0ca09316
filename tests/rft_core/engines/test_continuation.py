"""Continuing sequences from their tokens (partial rollouts, issue 48;
``rft_core.engines.continuation``): each engine gets the prompt and the response so far as one
sample's prompt, at most the chunk's budget of new tokens, and the seed the design names
(``seed + BUDGET_STRIDE * budget``, then the engine's own per-batch / per-request seeds). The HF
engine directly; vLLM and SGLang through their stand-ins (``tests/standins``, vLLM 0.33.0 and
SGLang 0.5.23: a ``TokensPrompt`` per prefix, ``input_ids`` per request)."""
from __future__ import annotations

import pytest

from rft_core.engines import SGLANG_SEED_BITS, VLLM_SEED_BITS, sample_seed
from rft_core.engines.continuation import BUDGET_STRIDE, continue_sequences
from rft_core.engines.hf import HFEngine
from rft_core.engines.sglang import SGLangEngine
from rft_core.engines.vllm import VLLMEngine
from tests.rft_core.engines.fakes import HFBackedLLM, HFBackedSGLang, SamplingParams

# two sequences of one prompt (5 tokens so far each) and one of another (2 so far), budgets 3, 3, 2
PREFIXES = [[1, 20, 30, 31, 32, 101, 102, 103, 104, 105], [1, 20, 30, 31, 32, 201, 202, 203, 204, 205], [1, 40, 301, 302]]
BUDGETS = [3, 3, 2]
SEED = 17


def test_the_hf_engine_continues_each_prefix_as_the_seeding_rule_says(parts):
    model, tok = parts
    eng = HFEngine(model, tok)
    gens = continue_sequences(eng, PREFIXES, BUDGETS, temperature=0.9, top_p=1.0, batch_size=2, seed=SEED)
    assert [g.prompt_index for g in gens] == [0, 1, 2] and [len(g.response_token_ids) for g in gens] == BUDGETS
    # the rule: one generate per budget, n = 1, seeded seed + BUDGET_STRIDE * budget
    for budget in (2, 3):
        idx = [i for i, b in enumerate(BUDGETS) if b == budget]
        want = eng.generate([PREFIXES[i] for i in idx], n_samples_per_prompt=1, max_new_tokens=budget, temperature=0.9,
                            batch_size=2, seed=SEED + BUDGET_STRIDE * budget)
        for i, w in zip(idx, want):
            assert (gens[i].response_token_ids, gens[i].logprobs) == (w.response_token_ids, w.logprobs)
    again = continue_sequences(eng, PREFIXES, BUDGETS, temperature=0.9, top_p=1.0, batch_size=2, seed=SEED)
    assert [(g.response_token_ids, g.logprobs) for g in again] == [(g.response_token_ids, g.logprobs) for g in gens]
    other = continue_sequences(eng, PREFIXES, BUDGETS, temperature=0.9, top_p=1.0, batch_size=2, seed=SEED + 1)
    assert [g.response_token_ids for g in other] != [g.response_token_ids for g in gens]  # the seed matters
    with pytest.raises(ValueError, match="every budget must be >= 1"):
        continue_sequences(eng, PREFIXES, [3, 0, 2], temperature=0.9, top_p=1.0, batch_size=2, seed=SEED)


def test_vllm_gets_prompt_plus_partial_response_as_token_prompts(parts):
    model, tok = parts
    llm = HFBackedLLM(model, tok)
    eng = VLLMEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, llm=llm, sampling_params=SamplingParams)
    gens = continue_sequences(eng, PREFIXES, BUDGETS, temperature=0.9, top_p=1.0, batch_size=8, seed=SEED)
    assert [len(g.response_token_ids) for g in gens] == BUDGETS and [g.prompt_index for g in gens] == [0, 1, 2]
    # one LLM.generate per budget (2 first), every prefix a TokensPrompt of its tokens, n = 1, max_tokens = budget
    assert [[r["prompt_token_ids"] for r in call[0]] for call in llm.calls] == [[PREFIXES[2]], [PREFIXES[0], PREFIXES[1]]]
    assert [[(sp.n, sp.max_tokens) for sp in call[1]] for call in llm.calls] == [[(1, 2)], [(1, 3), (1, 3)]]
    assert [sp.seed for sp in llm.calls[1][1]] == [sample_seed(SEED + BUDGET_STRIDE * 3, p, 0, 1, bits=VLLM_SEED_BITS)
                                                   for p in (0, 1)]
    # what vLLM answers for that request is what the stand-in's HF generation gives on those tokens
    seed = sample_seed(SEED + BUDGET_STRIDE * 2, 0, 0, 1, bits=VLLM_SEED_BITS)
    want = HFEngine(model, tok).generate([PREFIXES[2]], n_samples_per_prompt=1, max_new_tokens=2, temperature=0.9,
                                         seed=seed, batch_size=1)[0]
    assert gens[2].response_token_ids == want.response_token_ids and gens[2].logprobs == want.logprobs


def test_sglang_gets_prompt_plus_partial_response_as_input_ids(parts):
    model, tok = parts
    fake = HFBackedSGLang(model, tok)
    eng = SGLangEngine("unused", eos_ids=HFEngine(model, tok).eos_ids, engine=fake, deterministic=True)
    gens = continue_sequences(eng, PREFIXES, BUDGETS, temperature=0.9, top_p=1.0, batch_size=8, seed=SEED)
    assert [len(g.response_token_ids) for g in gens] == BUDGETS
    assert [call[0] for call in fake.calls] == [[PREFIXES[2]], [PREFIXES[0], PREFIXES[1]]]
    assert [[sp["max_new_tokens"] for sp in call[1]] for call in fake.calls] == [[2], [3, 3]]
    assert [sp["sampling_seed"] for sp in fake.calls[1][1]] == [
        sample_seed(SEED + BUDGET_STRIDE * 3, p, 0, 1, bits=SGLANG_SEED_BITS) for p in (0, 1)]
