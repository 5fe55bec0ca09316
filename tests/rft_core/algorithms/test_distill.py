"""On-policy distillation's per-token signal (rft_core.algorithms.distill) against float64 loops:
the signal d_t = log nu(y_t) - log pi_old(y_t) and the advantages in both modes; the gradient of
the project's policy-gradient loss (token_logprobs -> ppo_clip -> token-mean) with those
advantages w.r.t. the student's logits; and its expectation over the sampled token, which is
the gradient of the exact reverse KL(pi || nu) (what the signal estimates)."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms import POLICY_LOSSES
from rft_core.algorithms.distill import distillation_advantages, reverse_kl_signal
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.models.logprobs import token_logprobs

B, T, V = 3, 5, 7
LENGTHS = [5, 3, 4]


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    mask[0, 1] = False  # an observation token inside a multi-turn response
    task = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    returns = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    return old, teacher, mask, task, returns


def test_signal_and_advantages_equal_a_float64_loop():
    old, teacher, mask, task, returns = _case()
    coef = 0.7
    d_ref = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                d_ref[b][t] = -(float(old[b, t]) - float(teacher[b, t]))  # -(log pi_old - log nu)
    d = reverse_kl_signal(old, teacher, mask)
    assert d.dtype == torch.float64 and d.abs().max() > 0.1
    torch.testing.assert_close(d, torch.tensor(d_ref, dtype=torch.float64), atol=1e-15, rtol=0)

    adv, ret, metrics = distillation_advantages(task, returns, old, teacher, mask, coef=coef, use_task_rewards=True)
    for b in range(B):
        for t in range(T):
            assert float(adv[b, t]) == pytest.approx(float(task[b, t]) + coef * d_ref[b][t], abs=1e-14)
    assert torch.equal(ret, returns)  # the task returns: the signal has discount 0
    alone, ret_alone, _ = distillation_advantages(task, returns, old, teacher, mask, coef=coef, use_task_rewards=False)
    torch.testing.assert_close(alone, coef * torch.tensor(d_ref, dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.equal(ret_alone, alone)
    n = int(mask.sum())
    kl = sum(-d_ref[b][t] for b in range(B) for t in range(T) if mask[b, t]) / n
    assert metrics["distill_reverse_kl"] == pytest.approx(kl, abs=1e-12)
    assert metrics["distill_advantage_mean"] == pytest.approx(-coef * kl, abs=1e-12)


def test_refusals():
    old, teacher, mask, task, returns = _case()
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl_signal(old, teacher[:, :4], mask)
    with pytest.raises(ValueError, match="coef must be > 0"):
        distillation_advantages(task, returns, old, teacher, mask, coef=0.0, use_task_rewards=True)


def _project_loss(logits: torch.Tensor, targets: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor, *,
                  temperature: float, coef: float) -> torch.Tensor:
    """The update's loss of one on-policy step (old log-probs = the current ones, detached) with
    the distillation advantages alone: token_logprobs -> ppo_clip -> token-mean."""
    logp, _ = token_logprobs(logits, targets, temperature=temperature)
    old = logp.detach()
    adv, _, _ = distillation_advantages(torch.zeros_like(old), torch.zeros_like(old), old, teacher_lp, mask, coef=coef,
                                        use_task_rewards=False)
    out = POLICY_LOSSES["ppo_clip"](logp, old, adv, mask)
    return LOSS_AGGREGATIONS["token-mean"](out.token_loss, mask)


def test_policy_gradient_wrt_the_logits_equals_a_float64_loop():
    g = torch.Generator().manual_seed(1)
    temperature, coef = 0.8, 1.3
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    teacher_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    teacher_lp = torch.log_softmax(teacher_logits, -1).gather(-1, targets[..., None])[..., 0]
    _, _, mask, _, _ = _case()
    _project_loss(logits, targets, teacher_lp, mask, temperature=temperature, coef=coef).backward()

    n = int(mask.sum())
    ref = [[[0.0] * V for _ in range(T)] for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            z = [float(x) / temperature for x in logits.detach()[b, t]]
            lse = math.log(sum(math.exp(x) for x in z))
            p = [math.exp(x - lse) for x in z]
            y = int(targets[b, t])
            adv = coef * (float(teacher_lp[b, t]) - (z[y] - lse))  # coef * -(log pi_old - log nu)
            for v in range(V):
                # L = -(1/n) sum_t A_t * ratio_t, ratio 1: dL/dlogit_v = -(A_t / n) (1[v = y] - p_v) / temperature
                ref[b][t][v] = -adv / n * ((1.0 if v == y else 0.0) - p[v]) / temperature
    assert logits.grad.abs().max() > 1e-3
    torch.testing.assert_close(logits.grad, torch.tensor(ref, dtype=torch.float64), atol=1e-13, rtol=0)


def test_expected_gradient_is_the_gradient_of_the_reverse_kl():
    """Summed over every token the student can sample at a state, weighted by its probability, the
    per-token policy gradient with advantage -(log pi - log nu) is the gradient of KL(pi || nu):
    grad KL = sum_v pi_v (log pi_v - log nu_v) grad log pi_v (as sum_v pi_v grad log pi_v = 0)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 2
    nu = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    pi = torch.softmax(logits, -1)
    one = torch.ones(1, 1, dtype=torch.bool)
    expected = torch.zeros(V, dtype=torch.float64)
    for y in range(V):  # the sampled token y, with probability pi_y
        z = logits.clone()[None, None].requires_grad_(True)
        loss = _project_loss(z, torch.tensor([[y]]), nu[y].view(1, 1), one, temperature=1.0, coef=1.0)
        (grad,) = torch.autograd.grad(loss, z)
        expected += float(pi[y]) * grad[0, 0]
    z = logits.clone().requires_grad_(True)
    p, logp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    (kl_grad,) = torch.autograd.grad((p * (logp - nu)).sum(), z)
    assert kl_grad.abs().max() > 1e-2
    torch.testing.assert_close(expected, kl_grad, atol=1e-14, rtol=0)
