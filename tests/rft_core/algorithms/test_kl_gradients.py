"""KL estimators by the gradient they give: exact float64 expectations on a 4-way categorical.

pi_theta = softmax(theta), a fixed pi_ref. For an estimator k used as a loss term on a token
a ~ pi_theta (differentiable logprobs, fixed ref_logprobs, no importance weight) the expected
gradient is sum_a pi(a) * d/dtheta k(log pi_theta(a), log pi_ref(a)); as a reward penalty it is
sum_a pi(a) * k(a) * d/dtheta log pi_theta(a). Both are compared with grad KL(pi||ref) and
grad KL(ref||pi) computed by autograd from the full distributions.
"""
from __future__ import annotations

import math

import pytest
import torch

from rft_core.algorithms.kl import (
    GRAD_KL_PI_REF,
    GRAD_KL_REF_PI,
    GRAD_L1,
    GRAD_ZERO,
    KL_ESTIMATORS,
    check_kl_loss_estimator,
    cpgd_policy_drift,
    kl_penalty,
)

D = torch.float64
THETA = torch.tensor([0.3, -1.1, 0.8, 0.05], dtype=D)
REF = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=D)


def _grad(fn) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(theta), theta)
    return g


def _logpi(theta):
    return torch.log_softmax(theta, -1)


def _references() -> dict[str, torch.Tensor]:
    logref = REF.log()
    g_pr = _grad(lambda th: (_logpi(th).exp() * (_logpi(th) - logref)).sum())  # grad KL(pi || ref)
    g_rp = _grad(lambda th: (REF * (logref - _logpi(th))).sum())  # grad KL(ref || pi)
    g_e_k2 = _grad(lambda th: (_logpi(th).exp() * 0.5 * (_logpi(th) - logref) ** 2).sum())  # grad E_pi[k2]
    g_l1 = _grad(lambda th: (_logpi(th).exp() - REF).abs().sum())  # grad ||pi - ref||_1 (verl's abs as a loss)
    g_e_abs = _grad(lambda th: (_logpi(th).exp() * (_logpi(th) - logref).abs()).sum())  # grad E_pi|log_ratio|
    return {
        GRAD_ZERO: torch.zeros(4, dtype=D),
        GRAD_KL_PI_REF: g_pr,
        GRAD_KL_REF_PI: g_rp,
        GRAD_L1: g_l1,
        "grad E_pi[k2] - grad KL(pi||ref)": g_e_k2 - g_pr,
        "grad KL(pi||ref) - grad KL(ref||pi)": g_pr - g_rp,
        "grad E_pi[abs] - grad ||pi - ref||_1": g_e_abs - g_l1,
    }


def test_references_differ_so_the_comparison_can_fail():
    refs = _references()
    names = list(refs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (refs[a] - refs[b]).abs().max() > 1e-3, (a, b)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_loss_mode_expected_gradient_matches_info(name):
    fn, info = KL_ESTIMATORS[name], KL_ESTIMATORS.info(name)
    logref = REF.log()

    def expected_loss(theta):  # sum_a sg(pi(a)) * k(log pi(a), log ref(a))
        lp = _logpi(theta)
        return (lp.exp().detach() * fn(lp, logref)).sum()

    got = _grad(expected_loss)
    want = _references()[info.loss_gradient]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_reward_mode_expected_gradient_matches_info(name):
    fn, info = KL_ESTIMATORS[name], KL_ESTIMATORS.info(name)
    logref = REF.log()

    def surrogate(theta):  # REINFORCE with the (detached) penalty as the reward: sum_a sg(pi k) log pi
        lp = _logpi(theta)
        return (lp.exp().detach() * fn(lp, logref).detach() * lp).sum()

    torch.testing.assert_close(_grad(surrogate), _references()[info.reward_gradient], rtol=0, atol=1e-12)


def test_expected_values():
    # E_pi[k1] = E_pi[k3] = KL(pi||ref) exactly (Schulman 2020); the "+" variants keep the value
    lp, logref = _logpi(THETA), REF.log()
    pi = lp.exp()
    kl = float((pi * (lp - logref)).sum())
    for name in ("k1", "k3", "k1+", "k3+", "low_var_kl", "low_var_kl+"):
        assert float((pi * KL_ESTIMATORS[name](lp, logref)).sum()) == pytest.approx(kl, abs=1e-14), name


def test_values_hand_computed_unchanged():
    # log_ratio = ln 2 and -ln 3
    lp = torch.log(torch.tensor([[0.5, 0.1]], dtype=D))
    ref = torch.log(torch.tensor([[0.25, 0.3]], dtype=D))
    ln2, ln3 = math.log(2), math.log(3)
    want = {"k1": [ln2, -ln3], "k2": [0.5 * ln2**2, 0.5 * ln3**2], "k3": [0.5 - 1 + ln2, 3 - 1 - ln3]}
    for name, vals in want.items():
        torch.testing.assert_close(KL_ESTIMATORS[name](lp, ref), torch.tensor([vals], dtype=D), rtol=0, atol=1e-14)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for alias, base in (("mse", "k2"), ("low_var_kl", "k3"), ("k1+", "k1"), ("k3+", "k3"), ("low_var_kl+", "k3")):
        torch.testing.assert_close(kl_penalty(lp, ref, mask, estimator=alias),
                                   kl_penalty(lp, ref, mask, estimator=base), rtol=0, atol=0)


@pytest.mark.parametrize("name,base", [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_penalty_value_and_gradient(name, base):
    # log ratios spanning the value clamp: -3 (k3 = e^3 - 1 - 3 = 16.1 > 10), -0.5, 0.2, 5 (masked);
    # the gradient equals plain k2's where k2's value is under the clamp (|log_ratio| <= 4.47)
    ref = torch.log(torch.tensor([[0.3, 0.2, 0.25, 0.4]], dtype=D))
    log_ratio = torch.tensor([[-3.0, -0.5, 0.2, 5.0]], dtype=D)
    mask = torch.tensor([[True, True, True, False]])
    lp = (ref + log_ratio).requires_grad_(True)
    st = kl_penalty(lp, ref, mask, estimator=name)
    (g_st,) = torch.autograd.grad(st.sum(), lp)
    lp2 = (ref + log_ratio).requires_grad_(True)
    (g_k2,) = torch.autograd.grad(kl_penalty(lp2, ref, mask, estimator="k2").sum(), lp2)
    torch.testing.assert_close(st.detach(), kl_penalty(lp.detach(), ref, mask, estimator=base), rtol=0, atol=0)
    torch.testing.assert_close(g_st, g_k2, rtol=0, atol=0)
    # k2's gradient is the log ratio (0 where masked); hand values
    torch.testing.assert_close(g_st, torch.tensor([[-3.0, -0.5, 0.2, 0.0]], dtype=D), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name,value_of", [("k3+", "k3"), ("low_var_kl+", "k3"), ("k1+", "k1")])
def test_straight_through_gradient_survives_large_log_ratios(name, value_of):
    # issue 29: the k2 term carrying the gradient used to be clamped to +-kl_clamp, so its gradient
    # was exactly 0 once 0.5 * log_ratio**2 > 10 (|log_ratio| > 4.47). Now d kl / d log pi is
    # log_ratio up to |log_ratio| = kl_clamp and +-kl_clamp beyond (never 0); the value is unchanged.
    ref = torch.log(torch.tensor([[0.3, 0.2, 0.25, 0.4, 0.1, 0.5]], dtype=D))
    log_ratio = torch.tensor([[6.0, -6.0, 12.0, -12.0, 0.5, -3.0]], dtype=D)
    mask = torch.ones(1, 6, dtype=torch.bool)
    lp = (ref + log_ratio).requires_grad_(True)
    kl = kl_penalty(lp, ref, mask, estimator=name)  # kl_clamp 10 (default)
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    assert grad.tolist() == [[6.0, -6.0, 10.0, -10.0, 0.5, -3.0]]
    # the values: clamp(k, -10, 10), by hand
    k3 = [math.exp(-6) - 1 + 6, math.exp(6) - 1 - 6, math.exp(-12) - 1 + 12, math.exp(12) - 1 - 12,
          math.exp(-0.5) - 1 + 0.5, math.exp(3) - 1 - 3]  # 5.0025, 396.4, 11.000006, 162742, 0.1065, 16.09
    raw = k3 if value_of == "k3" else log_ratio[0].tolist()
    want = [max(min(v, 10.0), -10.0) for v in raw]
    torch.testing.assert_close(kl.detach(), torch.tensor([want], dtype=D), rtol=0, atol=1e-15)
    # with a wider clamp the gradient is k2's, log_ratio, at 12 too
    lp2 = (ref + log_ratio).requires_grad_(True)
    (grad2,) = torch.autograd.grad(kl_penalty(lp2, ref, mask, estimator=name, kl_clamp=20.0).sum(), lp2)
    torch.testing.assert_close(grad2, log_ratio, rtol=0, atol=1e-12)
    # masked tokens: value 0, gradient 0, even with non-finite log-probs there
    lp3 = (ref + log_ratio).detach().clone()
    lp3[0, 2], mask3 = float("nan"), torch.tensor([[True, True, False, True, True, True]])
    lp3.requires_grad_(True)
    kl3 = kl_penalty(lp3, ref, mask3, estimator=name)
    (grad3,) = torch.autograd.grad(kl3.sum(), lp3)
    assert kl3[0, 2].item() == 0.0 and grad3.tolist() == [[6.0, -6.0, 0.0, -10.0, 0.5, -3.0]]
    # an underflowed reference (-inf): finite value (the clamp) and gradient (saturated)
    lp4 = torch.tensor([[-1.0]], dtype=D, requires_grad=True)
    kl4 = kl_penalty(lp4, torch.tensor([[-math.inf]], dtype=D), torch.ones(1, 1, dtype=torch.bool), estimator=name)
    (grad4,) = torch.autograd.grad(kl4.sum(), lp4)
    assert kl4.item() == 10.0 and grad4.item() == 10.0


@pytest.mark.parametrize("name", ["k3+", "k1+"])
def test_straight_through_expected_gradient_is_grad_kl_far_from_the_reference(name):
    # a policy that drifted far: log pi - log ref from -7.4 to 6.9 on a 4-way categorical; through
    # kl_penalty (clamp and all) the loss-mode expected gradient is still grad KL(pi||ref) exactly
    # (before issue 29 the tokens past |log_ratio| 4.47 contributed nothing)
    theta = torch.tensor([8.0, 0.0, -0.5, 0.3], dtype=D)
    ref = torch.tensor([0.001, 0.333, 0.333, 0.333], dtype=D)
    log_ratio = torch.log_softmax(theta, -1) - ref.log()
    assert log_ratio.abs().max() < 10.0 and (log_ratio.abs() > 4.5).sum() == 4
    mask = torch.ones(1, 4, dtype=torch.bool)

    def expected_loss(th):
        lp = _logpi(th)
        return (lp.exp().detach() * kl_penalty(lp[None], ref.log()[None], mask, estimator=name)[0]).sum()

    def kl_pi_ref(th):
        lp = _logpi(th)
        return (lp.exp() * (lp - ref.log())).sum()

    th1 = theta.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(expected_loss(th1), th1)
    th2 = theta.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(kl_pi_ref(th2), th2)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_check_kl_loss_estimator():
    with pytest.raises(ValueError, match=r"'k1'.*zero expected gradient.*k1\+, k2, k3\+, low_var_kl\+, mse.*k3, low_var_kl"):
        check_kl_loss_estimator("k1")
    for name in ("k2", "k3", "k1+", "k3+", "mse", "low_var_kl", "low_var_kl+"):
        assert check_kl_loss_estimator(name).loss_gradient != GRAD_ZERO
    with pytest.raises(KeyError, match="valid names"):
        check_kl_loss_estimator("k4")


# ---------------------------------------------------------------- CPGD drift
def test_cpgd_drift_hand_computed():
    # r = pi_theta / pi_old = 2, 0.5, 1: d = r - 1 - ln r
    old = torch.log(torch.tensor([[0.2, 0.4, 0.3]], dtype=D))
    lp = torch.log(torch.tensor([[0.4, 0.2, 0.3]], dtype=D))
    d = cpgd_policy_drift(lp, old, torch.tensor([[True, True, False]]))
    want = torch.tensor([[1 - math.log(2), -0.5 + math.log(2), 0.0]], dtype=D)
    torch.testing.assert_close(d, want, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="one shape"):
        cpgd_policy_drift(lp, old[:, :2], torch.ones(1, 3, dtype=torch.bool))


def test_cpgd_drift_estimates_kl_old_to_theta_with_its_exact_gradient():
    # tokens sampled from pi_old: E_old[d] = KL(pi_old || pi_theta), E_old[grad d] = grad KL(pi_old || pi_theta)
    old = torch.tensor([0.4, 0.1, 0.3, 0.2], dtype=D)
    mask = torch.ones(1, 4, dtype=torch.bool)

    def expected_drift(theta):
        return (old * cpgd_policy_drift(_logpi(theta)[None], old.log()[None], mask)[0]).sum()

    lp = _logpi(THETA)
    assert float(expected_drift(THETA)) == pytest.approx(float((old * (old.log() - lp)).sum()), abs=1e-14)
    g_kl_old_theta = _grad(lambda th: (old * (old.log() - _logpi(th))).sum())
    torch.testing.assert_close(_grad(expected_drift), g_kl_old_theta, rtol=0, atol=1e-12)
    # and it is not the KL to the reference
    assert (g_kl_old_theta - _references()[GRAD_KL_REF_PI]).abs().max() > 1e-3
    # zero with zero gradient at theta = old
    theta0 = old.log().clone().requires_grad_(True)
    val = expected_drift(theta0)
    (g0,) = torch.autograd.grad(val, theta0)
    assert abs(float(val.detach())) < 1e-15 and float(g0.abs().max()) < 1e-15
