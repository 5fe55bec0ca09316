"""DPPO-Binary-TV and DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879; ``dppo_tv``, ``dppo_kl``).

Three checks, as for the losses of issue 29:
- a float64 reference: a loop over the tokens with plain numbers, written from the paper's eq. 11
  (L = -M r A) and the binary divergences of eq. 13-14, value and gradient (the gradient of a kept
  token is -r A d log pi, or -min(r, C) A with verl's truncation), several seeds and thresholds;
- verl's own numbers (``data/verl_objectives.json``, ``benchmarks/verl_fixtures/make_objective_fixtures.py``,
  verl commit 1dda039b): the gradient exactly; the value in verl's form -A sg(min(r, C)) M log pi
  rebuilt with our mask (so every token's keep/drop decision is verl's); verl's masked fraction;
- the config: the names, their defaults, the rule that the anchor is the rollout's log-probs, and
  a tiny ``ppo_update`` with each.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rft_core.algorithms import POLICY_LOSSES
from rft_core.algorithms.divergence_losses import binary_kl, dppo_trust_region_mask
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.config import ConfigError, load_config, policy_loss_kwargs
from tests.rft_core.training.test_multiturn_masks import GradRecorder

D = torch.float64
DATA = json.loads((Path(__file__).parent / "data" / "verl_objectives.json").read_text())
NAMES = ["dppo_tv", "dppo_kl"]


def _inputs(seed: int, *, B: int = 4, T: int = 7, scale: float = 0.5):
    """log-probabilities (mu in (0.03, 0.95), pi = mu e^noise <= 0.99) and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    mu = 0.03 + 0.92 * torch.rand(B, T, generator=g, dtype=D)
    pi = (mu * torch.exp(scale * torch.randn(B, T, generator=g, dtype=D))).clamp(max=0.99)
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    return pi.log(), mu.log(), adv, mask


def _loop(name, lp, old, adv, mask, clip_low, clip_high, cap):
    """(value, d value / d lp) of the token-mean loss, token by token with plain floats."""
    toks = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    value, grad = 0.0, torch.zeros_like(lp)
    for i, t in toks:
        p, mu, a = math.exp(float(lp[i, t])), math.exp(float(old[i, t])), float(adv[i, t])
        if name == "dppo_tv":  # eq. 13: |pi - mu| against delta, in the advantage's direction
            out = p - mu > clip_high if a > 0 else p - mu < -clip_low
        else:  # eq. 14: KL(Bern(mu) || Bern(pi)), the 1e-8 guard as verl
            d = mu * math.log(mu / p) + (1 - mu) * math.log((1 - mu + 1e-8) / (1 - p + 1e-8))
            out = (d > clip_high and p > mu) if a > 0 else (d > clip_low and p < mu)
        if out:
            continue
        r = p / mu
        value += -r * a
        grad[i, t] = -(r if cap is None else min(r, cap)) * a
    return value / len(toks), grad / len(toks)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, clip_low, clip_high, cap", [
    ("dppo_tv", 0.15, 0.15, None), ("dppo_tv", 0.05, 0.3, None), ("dppo_tv", 0.2, 0.1, 1.2),
    ("dppo_kl", 0.05, 0.05, None), ("dppo_kl", 0.01, 0.1, None), ("dppo_kl", 0.08, 0.03, 1.3),
])
def test_against_the_loop(seed, name, clip_low, clip_high, cap):
    lp, old, adv, mask = _inputs(seed)
    lp = lp.requires_grad_(True)
    out = POLICY_LOSSES[name](lp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, ratio_cap=cap)
    got = LOSS_AGGREGATIONS["token-mean"](out.token_loss, mask)
    (grad,) = torch.autograd.grad(got, lp)
    want, want_grad = _loop(name, lp.detach(), old, adv, mask, clip_low, clip_high, cap)
    assert float(got.detach()) == pytest.approx(want, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    dropped = out.clipped
    assert dropped.any() and (~dropped & mask).any() and not dropped[~mask].any()  # the trust region acts
    if cap is not None:  # the truncation changes the gradient of some kept token
        ratio = (lp.detach() - old).exp()
        assert bool(((ratio > cap) & mask & ~dropped & (adv != 0)).any())


def test_by_hand():
    """mu = 0.5, pi = 0.7 (r = 1.4): TV 0.2, binary KL 0.5 ln(5/7) + 0.5 ln(5/3) = 0.0871777."""
    lp, old = torch.log(torch.tensor([[0.7, 0.7]], dtype=D)), torch.log(torch.tensor([[0.5, 0.5]], dtype=D))
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=D), torch.ones(1, 2, dtype=torch.bool)
    assert float(binary_kl(old, lp)[0, 0]) == pytest.approx(0.5 * math.log(5 / 7) + 0.5 * math.log(5 / 3), abs=1e-8)
    for name, delta in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):  # pushed up past delta with A > 0: dropped
        x = lp.clone().requires_grad_(True)
        out = POLICY_LOSSES[name](x, old, adv, mask, clip_low=delta, clip_high=delta)
        (g,) = torch.autograd.grad(out.token_loss.sum(), x)
        assert out.clipped.tolist() == [[True, False]]
        torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[0.0, 1.4]], dtype=D), rtol=0, atol=1e-14)
        torch.testing.assert_close(g, torch.tensor([[0.0, 1.4]], dtype=D), rtol=0, atol=1e-14)
    # inside the region (delta 0.25 TV, 0.1 KL) both are kept: -r A each, gradient -r A
    assert not dppo_trust_region_mask(lp, old, adv, divergence="tv", clip_low=0.25, clip_high=0.25).logical_not().any()
    assert not dppo_trust_region_mask(lp, old, adv, divergence="kl", clip_low=0.1, clip_high=0.1).logical_not().any()


@pytest.mark.parametrize("name", NAMES)
def test_masked_positions_weights_and_refusals(name):
    lp, old, adv, mask = _inputs(5)
    out = POLICY_LOSSES[name](lp, old, adv, mask)
    lp2, adv2 = lp.clone(), adv.clone()
    lp2[~mask], adv2[~mask] = -1e3, 1e3
    torch.testing.assert_close(POLICY_LOSSES[name](lp2, old, adv2, mask).token_loss, out.token_loss)
    assert (out.token_loss[~mask] == 0).all()
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    torch.testing.assert_close(POLICY_LOSSES[name](lp, old, adv, mask, w).token_loss, out.token_loss * w)
    for bad, match in (({"clip_low": -0.1}, "clip_low"), ({"ratio_cap": 0.0}, "ratio_cap")):
        with pytest.raises(ValueError, match=match):
            POLICY_LOSSES[name](lp, old, adv, mask, **bad)
    assert not POLICY_LOSSES.info(name).batch_dependent and POLICY_LOSSES.info(name).required_loss_agg is None


# ---------------------------------------------------------------- verl's own numbers


def test_verl_data_records_its_source():
    assert DATA["verl_commit"].startswith("1dda039b") and {c["loss"] for c in DATA["dppo"]} == set(NAMES)


@pytest.mark.parametrize("case", DATA["dppo"], ids=lambda c: c["case"])
def test_matches_verl(case):
    data = {k: torch.tensor(v, dtype=torch.bool if k == "response_mask" else D) for k, v in case["inputs"].items()}
    lp, mask, adv = data["log_prob"].clone().requires_grad_(True), data["response_mask"], data["advantages"]
    w = data.get("rollout_is_weights")
    agg = LOSS_AGGREGATIONS[case["loss_agg_mode"]]
    out = POLICY_LOSSES[case["loss"]](lp, data["old_log_prob"], adv, mask, w, **case["kwargs"])
    got = agg(out.token_loss, mask)
    (grad,) = torch.autograd.grad(got, lp)
    torch.testing.assert_close(grad, torch.tensor(case["verl_grad_log_prob"], dtype=D), rtol=1e-12, atol=1e-14)
    if case["kwargs"].get("ratio_cap") is not None:  # the case exercises the truncation
        uncapped = POLICY_LOSSES[case["loss"]](lp, data["old_log_prob"], adv, mask, w,
                                               **{**case["kwargs"], "ratio_cap": None})
        (g2,) = torch.autograd.grad(agg(uncapped.token_loss, mask), lp)
        assert (g2 - grad).abs().max() > 1e-3
    # verl's value, -A sg(min(r, C)) M log pi (same gradient, another value), with our M
    cap = case["verl_config"]["clip_ratio_c"]
    kept = (~out.clipped).to(D)
    trunc = (lp.detach() - data["old_log_prob"]).exp().clamp(max=cap)
    verl_form = -adv * trunc * kept * lp.detach() * (w if w is not None else 1.0)
    assert float(agg(verl_form, mask)) == pytest.approx(case["verl_loss"], rel=1e-12, abs=1e-14)
    frac = float((out.clipped & mask).sum()) / int(mask.sum())  # verl's: a float32 mean over count + 1e-8
    assert frac == pytest.approx(case["verl_masked_frac"], rel=1e-6) and 0 < frac < 1


# ---------------------------------------------------------------- config and update wiring


@pytest.mark.parametrize("name, delta", [("dppo_tv", 0.15), ("dppo_kl", 0.05)])
def test_config_name_reaches_the_registry(name, delta):
    cfg = load_config(None, {"update.policy_loss": name})
    assert cfg.update.policy_loss.name == name and cfg.update.loss_agg == "token-mean"
    assert policy_loss_kwargs(cfg.update.policy_loss) == {"clip_low": delta, "clip_high": delta, "ratio_cap": None}
    assert not cfg.recomputes_old_logprobs  # the default config anchors on the rollout's log-probs


def test_config_refuses_the_actor_pass_and_bad_thresholds():
    with pytest.raises(ConfigError, match=r"update.policy_loss.name=dppo_tv .*logprobs.recompute_old_logprobs=auto "
                                          r"runs the actor pass here \(more than one optimizer step"):
        load_config(None, {"update.policy_loss": "dppo_tv", "update.epochs": 2})
    with pytest.raises(ConfigError, match="logprobs.recompute_old_logprobs=true runs the actor pass"):
        load_config(None, {"update.policy_loss": "dppo_kl", "logprobs.recompute_old_logprobs": True})
    ok = load_config(None, {"update.policy_loss": "dppo_kl", "update.epochs": 2, "logprobs.recompute_old_logprobs": False})
    assert ok.update.policy_loss.name == "dppo_kl" and not ok.recomputes_old_logprobs
    for bad in ({"name": "dppo_tv", "clip_high": 1.5}, {"name": "dppo_kl", "clip_low": -1}, {"name": "dppo_tv", "ratio_cap": 0}):
        with pytest.raises(ConfigError):
            load_config(None, {"update.policy_loss": bad})


@pytest.mark.parametrize("name", NAMES)
def test_ppo_update_runs_each(tiny_model, name):
    from rft_core.models.loading import load_causal_lm
    from rft_core.training.update import ppo_update
    from tests.update_settings import update_settings
    from tests.rft_core.algorithms.test_policy_losses_2025 import _update_data

    # thresholds 0: every token that moved in its advantage's direction leaves the region (the tiny model's
    # probabilities are ~1/500, so its TV and binary KL stay below the defaults)
    upd = load_config(None, {"update.policy_loss": {"name": name, "clip_low": 0.0, "clip_high": 0.0}}).update
    strategy = GradRecorder(load_causal_lm(tiny_model, trainable=True))
    steps = ppo_update(strategy, _update_data(tiny_model), update_settings(policy_loss=upd.policy_loss, loss_agg=upd.loss_agg, micro_batch_size=2), pad_token_id=2)
    assert len(steps) == 1 and math.isfinite(steps[0].policy_loss) and 0 < steps[0].clip_frac < 1
    assert any(g.abs().max() > 0 for g in strategy.grads[0].values())
