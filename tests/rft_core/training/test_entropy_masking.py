"""The entropy bonus of the update is -entropy_coef * agg_M(e_t * H_t) (docs/algorithms.md, "Loss terms
of the update"): the high-entropy filter e_t selects its tokens, the rollout correction never does
(issue 39: it used to drop the correction-masked tokens, but only while the filter was on). Checked
as one exact SGD step on the tiny model against a float64 loop over tokens."""
from __future__ import annotations

import math

import torch

from rft_core.models.loading import load_causal_lm
from rft_core.training.strategy import SingleProcess
from rft_core.training.update import UpdateData, ppo_update, rollout_correction_weights
from tests.update_settings import update_settings

PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25], [31, 32], [41, 42, 43, 44]]
RESPONSES = [[101, 102, 103, 104], [201, 202], [301, 302, 303, 304, 305], [401, 402, 403]]  # 14 tokens
# the filter keeps token 0 of every response (its entropy is the highest: top 4 of 14)
ENTROPIES = [[10.0 + i] + [0.0] * (len(r) - 1) for i, r in enumerate(RESPONSES)]
# rho_t = pi_old / pi_rollout: icepop with [0.75, 2] masks token 0 of responses 0 and 2 and token 2 of response 2
RHO = [[0.5, 1.0, 1.0, 1.0], [1.0, 1.0], [3.0, 1.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0]]
LR, COEF = 1.0, 20.0


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _data() -> UpdateData:
    old = [[-1.0] * len(r) for r in RESPONSES]
    return UpdateData(PROMPTS, RESPONSES, old, [[0.0] * len(r) for r in RESPONSES], entropies=ENTROPIES,
                      rollout_logprobs=[[o - math.log(p) for o, p in zip(os, ps)] for os, ps in zip(old, RHO)])


def _step(tiny_model, data: UpdateData, correction=None, **kw) -> torch.Tensor:
    """The parameter change of one plain SGD step (no clipping) of ``ppo_update`` with the entropy
    bonus alone: every advantage 0 gives the policy term value 0 and gradient 0, no KL."""
    model = load_causal_lm(tiny_model, trainable=True)
    base = _flat(model)
    ppo_update(SingleProcess(model, torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=1e9), data,
               update_settings(entropy_coef=COEF, micro_batch_size=3, **kw), pad_token_id=2, correction=correction)
    return _flat(model) - base


def _reference(tiny_model, tokens: list[list[int]], normaliser: int) -> torch.Tensor:
    """-LR * grad of -COEF * sum over the listed tokens of H_t / normaliser, in float64, one
    token at a time: H_t = -sum_v p_v log p_v of the model's next-token distribution before
    response token t (``tokens[i]``: the token positions of response i)."""
    model = load_causal_lm(tiny_model, trainable=True).to(torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for p, r, ts in zip(PROMPTS, RESPONSES, tokens):
        logits = model(input_ids=torch.tensor([p + r])).logits[0]
        for t in ts:
            logp = torch.log_softmax(logits[len(p) + t - 1], -1)
            loss = loss - COEF * -(logp.exp() * logp).sum() / normaliser
    loss.backward()
    return torch.cat([-LR * q.grad.flatten() for q in model.parameters()]).float()


def test_the_correction_never_masks_the_entropy_bonus(tiny_model):
    data = _data()
    corr = rollout_correction_weights(data, mode="icepop", cap=2.0, low=0.75)
    assert corr.keep[0].tolist() == [False, True, True, True] and corr.keep[2].tolist() == [False, True, False, True, True]
    first = [[0]] * 4  # the tokens the filter keeps
    # the filter with the full-count normaliser: e_t * H_t over all 14 tokens, the masked first tokens included
    want = _reference(tiny_model, first, 14)
    assert want.abs().max() > 1e-3  # the entropy term moves the weights
    got = _step(tiny_model, data, entropy_top_fraction=4 / 14, correction=corr)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # dropping the correction-masked tokens (responses 0 and 2) would be another step
    assert (_reference(tiny_model, [[], [0], [], [0]], 14) - want).abs().max() > 1e-4
    # no filter: every token, with and without the correction
    every = [list(range(len(r))) for r in RESPONSES]
    want_all = _reference(tiny_model, every, 14)
    torch.testing.assert_close(_step(tiny_model, data, correction=corr), want_all, atol=1e-6, rtol=0)
    torch.testing.assert_close(_step(tiny_model, data), want_all, atol=1e-6, rtol=0)
    # entropy_filter_norm "kept": the kept tokens, normalised by their count, masked ones included
    kept = _step(tiny_model, data, entropy_top_fraction=4 / 14, entropy_filter_norm="kept", correction=corr)
    torch.testing.assert_close(kept, _reference(tiny_model, first, 4), atol=1e-6, rtol=0)

