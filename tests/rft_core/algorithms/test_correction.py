"""Rollout/trainer mismatch correction (TIS, icepop, sequence masking): hand-computed float64 cases."""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms.correction import ROLLOUT_CORRECTIONS, rollout_correction
from rft_core.algorithms.policy_loss import POLICY_LOSSES, apply_token_weights
from rft_core.registry import UnknownNameError

D = torch.float64
MASK = torch.tensor([[True, True, True], [True, True, False]])


def _case():
    """old/rollout log-probs whose token ratios are [[3, 1, 0.5], [2.5, 1.5, (pad)]]."""
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.6], [0.2, 0.4, 0.3]], dtype=D))
    ratios = torch.tensor([[3.0, 1.0, 0.5], [2.5, 1.5, 1.0]], dtype=D)
    old = rollout + ratios.log()
    old[1, 2] = float("nan")  # padding may hold anything
    return old, rollout


def test_top_p_truncated_engine_ratio_is_point_eight():
    # the engine samples from [.5, .3, .2] truncated by top_p = 0.8 (renormalised over {.5, .3}),
    # the trainer's distribution is untruncated: for a kept token pi_old / pi_rollout = 0.5/0.625 = 0.3/0.375 = 0.8
    p = torch.tensor([0.5, 0.3, 0.2], dtype=D)
    q = torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0], dtype=D)
    old, rollout = p[:2].log()[None], q[:2].log()[None]
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = rollout_correction(old, rollout, mask, mode="tis", cap=2.0)
    torch.testing.assert_close(out.weights, torch.full((1, 2), 0.8, dtype=D), rtol=0, atol=1e-15)
    assert out.metrics["rollout_is_capped_frac"] == 0.0
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx(0.8, abs=1e-15)
    assert out.metrics["rollout_kl"] == pytest.approx(math.log(1.25), abs=1e-15)
    # E_q[w] = P_old(kept set) = 0.8: the correction reweights the kept tokens exactly, but the
    # truncated token (q = 0) is never sampled, which no weight can undo
    assert float((q[:2] * out.weights[0]).sum()) == pytest.approx(0.8, abs=1e-15)


def test_tis_expected_gradient_equals_on_policy_gradient_over_the_support():
    # E_{a~q}[w(a) grad(-A(a) log pi(a))] = sum_{a: q(a)>0} p(a) grad(-A(a) log pi(a)) when nothing is capped
    theta = torch.tensor([0.2, -0.4, 0.1], dtype=D)
    p = torch.softmax(theta, -1)
    q = torch.cat([p[:2] / p[:2].sum(), torch.zeros(1, dtype=D)])
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=D)
    w = rollout_correction(p[:2].log()[None], q[:2].log()[None], torch.ones(1, 2, dtype=torch.bool),
                           mode="tis", cap=10.0).weights[0]
    th = theta.clone().requires_grad_(True)
    lp = torch.log_softmax(th, -1)[:2]
    (g_is,) = torch.autograd.grad((q[:2] * w * (-adv[:2] * lp)).sum(), th)
    th2 = theta.clone().requires_grad_(True)
    (g_on,) = torch.autograd.grad((p[:2] * (-adv[:2] * torch.log_softmax(th2, -1)[:2])).sum(), th2)
    torch.testing.assert_close(g_is, g_on, rtol=0, atol=1e-14)


def test_tis_cap_and_low():
    old, rollout = _case()
    out = rollout_correction(old, rollout, MASK, mode="tis", cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 1.0, 0.5], [2.0, 1.5, 0.0]], dtype=D), rtol=0, atol=1e-14)
    assert torch.equal(out.loss_mask, MASK)
    m = out.metrics
    assert m["rollout_is_capped_frac"] == pytest.approx(2 / 5)
    assert m["rollout_is_weight_mean"] == pytest.approx(7.0 / 5, abs=1e-14)
    assert m["rollout_is_token_masked_frac"] == 0.0 and m["rollout_is_seq_masked_frac"] == 0.0
    assert m["rollout_kl"] == pytest.approx(-(math.log(3) + math.log(0.5) + math.log(2.5) + math.log(1.5)) / 5, abs=1e-14)
    low = rollout_correction(old, rollout, MASK, mode="tis", cap=2.0, low=0.6)
    assert float(low.weights[0, 2]) == pytest.approx(0.6, abs=1e-14)
    assert low.metrics["rollout_is_capped_frac"] == pytest.approx(3 / 5)
    assert low.metrics["rollout_is_weight_mean"] == pytest.approx(7.1 / 5, abs=1e-14)


def test_icepop_masks_tokens_outside_the_interval():
    old, rollout = _case()
    out = rollout_correction(old, rollout, MASK, mode="icepop", cap=2.0, low=0.5)
    assert torch.equal(out.loss_mask, torch.tensor([[False, True, True], [False, True, False]]))
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.5, 0.0]], dtype=D), rtol=0, atol=1e-14)
    m = out.metrics
    assert m["rollout_is_token_masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_is_seq_masked_frac"] == 0.0 and m["rollout_is_capped_frac"] == 0.0
    assert m["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-14)


def test_seq_mask_tis_uses_the_geometric_mean():
    # geometric means: row 0 (3 * 1 * 0.5)^(1/3) = 1.145, row 1 (2.5 * 1.5)^(1/2) = 1.936 > 1.9
    old, rollout = _case()
    out = rollout_correction(old, rollout, MASK, mode="seq-mask-tis", cap=1.9, low=0.5)
    assert torch.equal(out.loss_mask, torch.tensor([[True, True, True], [False, False, False]]))
    torch.testing.assert_close(out.weights, torch.tensor([[3.0, 1.0, 0.5], [0.0, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-14)
    m = out.metrics
    assert m["rollout_is_seq_masked_frac"] == 0.5
    assert m["rollout_is_token_masked_frac"] == pytest.approx(2 / 5)
    assert m["rollout_is_weight_mean"] == pytest.approx(1.5, abs=1e-14)
    kept = rollout_correction(old, rollout, MASK, mode="seq-mask-tis", cap=2.0, low=0.5)
    assert torch.equal(kept.loss_mask, MASK)


def test_sequence_mask_uses_the_product_ratio():
    # products: row 0 3 * 1 * 0.5 = 1.5 (kept, weight 1.5 on every token), row 1 2.5 * 1.5 = 3.75 > 3
    old, rollout = _case()
    out = rollout_correction(old, rollout, MASK, mode="sequence_mask", cap=3.0)
    torch.testing.assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-14)
    assert torch.equal(out.loss_mask, torch.tensor([[True, True, True], [False, False, False]]))
    assert out.metrics["rollout_is_seq_masked_frac"] == 0.5
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx(1.5, abs=1e-14)
    assert ROLLOUT_CORRECTIONS.info("sequence_mask").level == "sequence"


def test_weights_are_detached():
    old, rollout = _case()
    old = torch.where(MASK, old, torch.zeros_like(old)).requires_grad_(True)
    for mode in ROLLOUT_CORRECTIONS:  # mode none weighs nothing: it comes with a rejection mask
        rejection = {"rejection": "token_k3", "rejection_cap": 1.0} if mode == "none" else {}
        assert not rollout_correction(old, rollout, MASK, mode=mode, cap=5.0, low=0.1, **rejection).weights.requires_grad


def test_bad_input_errors():
    old, rollout = _case()
    with pytest.raises(UnknownNameError, match="icepop"):
        rollout_correction(old, rollout, MASK, mode="tis2")
    with pytest.raises(ValueError, match="one"):
        rollout_correction(old[:, :2], rollout, MASK)
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(old, rollout, MASK, cap=0.0)
    with pytest.raises(ValueError, match="low"):
        rollout_correction(old, rollout, MASK, cap=2.0, low=2.0)
    bad = rollout.clone()
    bad[0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"rollout_logprobs\[0, 1\]"):
        rollout_correction(old, bad, MASK)
    with pytest.raises(ValueError, match="bool"):
        rollout_correction(old, rollout, MASK.to(D))


# ---------------------------------------------------------------- weights in the policy losses
@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo", "cpgd"])
def test_policy_loss_weights_multiply_the_token_loss_and_its_gradient(name):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 3, generator=g, dtype=D)
    adv = torch.randn(2, 3, generator=g, dtype=D)
    w = torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.8, 3.0]], dtype=D, requires_grad=True)
    delta = 0.01 * torch.randn(2, 3, generator=g, dtype=D)
    fn = POLICY_LOSSES[name]
    lp = (old + delta).requires_grad_(True)
    plain = fn(lp, old, adv, MASK)
    weighted = fn(lp, old, adv, MASK, weights=w)
    torch.testing.assert_close(weighted.token_loss, plain.token_loss * w.detach(), rtol=0, atol=1e-15)
    assert torch.equal(weighted.clipped, plain.clipped)
    (g_plain,) = torch.autograd.grad(plain.token_loss.sum(), lp)
    lp2 = (old + delta).requires_grad_(True)
    (g_w,) = torch.autograd.grad(fn(lp2, old, adv, MASK, weights=w).token_loss.sum(), lp2)
    if name != "gspo":  # token-level losses: each token's gradient is scaled by its own weight
        torch.testing.assert_close(g_w, g_plain * w.detach(), rtol=0, atol=1e-15)
    assert w.grad is None
    torch.testing.assert_close(fn(lp, old, adv, MASK, weights=None).token_loss, plain.token_loss, rtol=0, atol=0)


def test_apply_token_weights_shape_error():
    with pytest.raises(ValueError, match="shape"):
        apply_token_weights(torch.zeros(2, 3), torch.ones(2, 2))
