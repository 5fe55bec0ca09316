"""Decoupled PPO (asynchronous RL, ``rollout.max_staleness`` >= 1; Fu et al. 2025, AReaL,
arXiv:2505.24298, eq. 5): the tokens come from a behaviour policy older than the update's
starting (proximal) policy. The PPO ratio is taken against the proximal policy (the actor pass
recomputes its log-probs) and the policy term is weighted by the behaviour importance ratio
pi_prox / pi_behav, truncated (``tis``) or masked (``icepop``, AReaL's ``behav_imp_weight_cap``)
at the cap. Checked in float64 against a loop over tokens, value and gradient."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms.correction import rollout_correction
from rft_core.algorithms.policy_loss import ppo_clip_loss

D = torch.float64
EPS = 0.2


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 6
    behav = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    prox = behav + torch.randn(B, T, generator=g, dtype=D) * 0.8  # the policy moved since the behaviour one
    logp = prox + torch.randn(B, T, generator=g, dtype=D) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.2
    return logp, prox, behav, adv, mask


def _reference(logp, prox, behav, adv, mask, mode: str, cap: float):
    """sum over masked tokens of -w * min(r A, clip(r) A) / number of tokens, and d/dlogp, by hand."""
    B, T = logp.shape
    n = int(mask.sum())
    loss, grad = 0.0, torch.zeros(B, T, dtype=D)
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            rho = math.exp(float(prox[i, t] - behav[i, t]))
            if mode == "tis":
                w = min(rho, cap)
            elif rho > cap:  # icepop: a token whose behaviour weight exceeds the cap leaves the loss
                continue
            else:
                w = rho
            r = math.exp(float(logp[i, t] - prox[i, t]))
            a = float(adv[i, t])
            unclipped, clipped = r * a, min(max(r, 1 - EPS), 1 + EPS) * a
            loss += -w * min(unclipped, clipped) / n
            if unclipped <= clipped:  # the unclipped branch is active: d(r A)/dlogp = r A
                grad[i, t] = -w * r * a / n
    return loss, grad


@pytest.mark.parametrize("mode", ["tis", "icepop"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_ppo_value_and_gradient(mode, seed):
    logp, prox, behav, adv, mask = _case(seed)
    cap = 2.0
    logp = logp.clone().requires_grad_(True)
    corr = rollout_correction(prox, behav, mask, mode=mode, cap=cap)
    out = ppo_clip_loss(logp, prox, adv, mask & corr.loss_mask, weights=corr.weights, clip_low=EPS, clip_high=EPS)
    loss = out.token_loss.sum() / mask.sum()  # token-mean with every response token in the normaliser
    loss.backward()
    want, want_grad = _reference(logp.detach(), prox, behav, adv, mask, mode, cap)
    assert float(loss) == pytest.approx(want, abs=1e-14)
    torch.testing.assert_close(logp.grad, want_grad, rtol=0, atol=1e-14)
    rho = torch.exp(prox - behav)[mask]
    assert corr.metrics["rollout_is_weight_max"] == pytest.approx(float(rho.clamp(max=cap).max() if mode == "tis"
                                                                        else rho[rho <= cap].max()), abs=1e-12)
    # KL(behaviour || proximal) estimated on the behaviour samples: mean(log pi_behav - log pi_prox)
    assert corr.metrics["rollout_kl"] == pytest.approx(float((behav - prox)[mask].mean()), abs=1e-12)


def test_without_staleness_the_weights_are_one_and_the_objective_is_ppo():
    """pi_prox = pi_behav (max_staleness 0 and an exact engine): every weight is 1."""
    logp, prox, _, adv, mask = _case(3)
    corr = rollout_correction(prox, prox, mask, mode="tis", cap=2.0)
    assert torch.equal(corr.weights, mask.to(D))
    plain = ppo_clip_loss(logp, prox, adv, mask, clip_low=EPS, clip_high=EPS).token_loss
    torch.testing.assert_close(ppo_clip_loss(logp, prox, adv, mask, weights=corr.weights, clip_low=EPS,
                                             clip_high=EPS).token_loss, plain, rtol=0, atol=0)
