"""HF engine speed-ups keep the outputs right: sorted/bucketed batches of whole groups, one
prompt prefill per group reused from the KV cache, original order, seeded determinism."""
from __future__ import annotations

import pytest

from rft_core.engines.hf import HFEngine
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs

PROMPTS = [[1, 20, 30, 31, 32], [1, 40], [7], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(load_causal_lm(tiny_model), load_tokenizer(tiny_model))


@pytest.mark.parametrize("batch_size", [2, 6, 64])
def test_logprobs_equal_teacher_forcing_with_shared_prefill(engine, batch_size):
    gens = engine.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=6, batch_size=batch_size, seed=3)
    assert [(g.prompt_index, g.sample_index) for g in gens] == [(p, k) for p in range(5) for k in range(3)]
    # a wrong cached prefix (positions, padding, row order) would change these log-probs
    want = batched_response_logprobs(engine.model, [PROMPTS[g.prompt_index] for g in gens],
                                     [g.response_token_ids for g in gens], pad_token_id=engine.pad_token_id)
    for g, lp in zip(gens, want):
        assert len(g.response_token_ids) == len(g.logprobs) > 0
        assert g.logprobs == pytest.approx(lp, abs=1e-4)


def test_same_seed_same_samples_whatever_the_input_order(engine):
    kw = dict(n_samples_per_prompt=2, max_new_tokens=5, batch_size=4, seed=9)
    a = engine.generate(PROMPTS, **kw)
    assert [g.response_token_ids for g in engine.generate(PROMPTS, **kw)] == [g.response_token_ids for g in a]
    # batches follow prompt length, not input position: a permuted request gives each prompt the same samples
    perm = [3, 0, 4, 2, 1]
    b = engine.generate([PROMPTS[i] for i in perm], **kw)
    by_prompt = {(perm[g.prompt_index], g.sample_index): g.response_token_ids for g in b}
    assert {(g.prompt_index, g.sample_index): g.response_token_ids for g in a} == by_prompt


def test_prompt_is_prefilled_once_per_group(engine):
    shapes: list[tuple[int, int]] = []
    handle = engine.model.get_input_embeddings().register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    try:
        engine.generate([PROMPTS[0], PROMPTS[3]], n_samples_per_prompt=4, max_new_tokens=3, batch_size=8)
        shared = list(shapes)
        shapes.clear()
        engine.generate([PROMPTS[0], PROMPTS[3]], n_samples_per_prompt=4, max_new_tokens=3, batch_size=8,
                        share_prefill=False)
        plain = list(shapes)
    finally:
        handle.remove()
    # shared: 2 prompts x 4 prefix tokens once, then all 8 rows start from the last prompt token
    assert shared[:2] == [(2, 4), (8, 1)] and all(s == (8, 1) for s in shared[2:])
    # plain: all 8 rows x 5 prompt tokens in the first step
    assert plain[0] == (8, 5) and all(s == (8, 1) for s in plain[1:])


def test_progress_reports_sequences(engine):
    calls: list[tuple[int, int, int]] = []
    gens = engine.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=2, batch_size=4,
                           progress=lambda d, t, tokens: calls.append((d, t, tokens)))
    # after each decode step and each batch: sequences finished and tokens generated, never going back
    assert [c[:2] for c in calls if c[0] in (4, 8, 10)][-1] == (10, 10)
    assert {4, 8, 10} <= {c[0] for c in calls} and all(c[1] == 10 for c in calls)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls) and [c[2] for c in calls] == sorted(c[2] for c in calls)
    assert calls[-1][2] == sum(len(g.response_token_ids) for g in gens)
