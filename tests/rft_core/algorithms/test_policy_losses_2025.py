"""The policy losses of issue 29 (cispo, gmpo = geo_mean, sapo, gpg, clip_cov, kl_cov).

Three checks per loss:
- a float64 reference: a plain Python loop over the tokens, written from the paper's equation
  (not from the vectorised code), value and gradient (torch.autograd.grad), several seeds;
- verl's own numbers (``data/verl_policy_losses.json``, written by
  ``benchmarks/verl_fixtures/make_policy_loss_fixtures.py`` from verl's ``core_algos.py`` at the
  commit it records): our function aggregated with the same ``loss_agg_mode``, value and
  gradient. They agree to float64 rounding. Known differences, none of them in the data: we clamp
  log-ratios to [-20, 20] where verl's geo_mean, clip_cov and kl_cov do not; our
  seq-mean-token-mean divides by every row while verl's skips all-masked rows (every row has
  tokens here); clip_cov's random pick (ours seeded by the candidates, verl's the global RNG:
  the data has no more candidates than picks); gmpo's ``weights`` (ours: arithmetic mean of the
  token weights of a response, verl: geometric mean; no gmpo case has weights);
- the config: each name validates, reaches ``POLICY_LOSSES`` with its keyword arguments, and a
  tiny ``ppo_update`` runs with it (gmpo's gradient checked against a float64 loop on the model).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rft_core.algorithms import POLICY_LOSSES
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS, check_policy_loss_aggregation, ppo_clip_loss
from rft_core.config import ConfigError, load_config, policy_loss_kwargs
from tests.rft_core.training.test_multiturn_masks import GradRecorder

D = torch.float64
DATA = Path(__file__).parent / "data" / "verl_policy_losses.json"
NEW = ["cispo", "gmpo", "geo_mean", "sapo", "gpg", "clip_cov", "kl_cov"]


def _inputs(seed: int, *, B: int = 4, T: int = 6, scale: float = 0.4, seq_adv: bool = False, adv_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    lp = -3.0 * torch.rand(B, T, generator=g, dtype=D)
    old = lp + scale * torch.randn(B, T, generator=g, dtype=D)
    adv = adv_scale * (torch.randn(B, 1, generator=g, dtype=D).expand(B, T).clone() if seq_adv
                       else torch.randn(B, T, generator=g, dtype=D))
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True  # every row has a token
    return lp, old, adv, mask


def _grad(scalar: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(scalar, lp, retain_graph=True)[0]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-10) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _tokens(mask: torch.Tensor):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def _vectorised(name: str, lp, old, adv, mask, agg: str, **kwargs):
    out = POLICY_LOSSES[name](lp, old, adv, mask, **kwargs)
    return LOSS_AGGREGATIONS[agg](out.token_loss, mask), out


# ---------------------------------------------------------------- float64 references (loops)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_low, clip_high", [(None, 0.2), (0.1, 0.3)])
def test_cispo_against_loop(seed, clip_low, clip_high):
    """MiniMax-M1 eq. 4-5: J = 1/sum|o_i| sum_i sum_t sg(r^_t) A_t log pi_t,
    r^_t = clip(r_t, 1 - eps_low, 1 + eps_high) (no lower bound when eps_low is None)."""
    lp, old, adv, mask = _inputs(seed)
    lp = lp.requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i, t in _tokens(mask):
        r = math.exp(float(lp[i, t].detach() - old[i, t]))  # a plain number: the stop-gradient
        r_hat = min(r, 1 + clip_high) if clip_low is None else min(max(r, 1 - clip_low), 1 + clip_high)
        total = total - r_hat * adv[i, t] * lp[i, t]
    want = total / len(_tokens(mask))
    got, out = _vectorised("cispo", lp, old, adv, mask, "token-mean", clip_low=clip_low, clip_high=clip_high)
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))
    assert out.clipped.any() and not out.clipped[~mask].any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_low, clip_high", [(0.4, 0.4), (0.1, 0.2)])
def test_gmpo_against_loop(seed, clip_low, clip_high):
    """GMPO's objective in ratio space: per response, the geometric mean of the token terms
    |min(rho_t A, clip(rho_t, e^-eps_low, e^eps_high) A)|, times sgn(A); 1/G over responses."""
    lp, old, adv, mask = _inputs(seed, seq_adv=True, scale=0.5)
    lp = lp.requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i in range(mask.shape[0]):
        a = float(adv[i, 0])
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        prod = torch.ones((), dtype=D)
        for t in ts:
            rho = torch.exp(lp[i, t] - old[i, t])
            term = torch.minimum(rho * a, rho.clamp(math.exp(-clip_low), math.exp(clip_high)) * a)
            prod = prod * term.abs()
        total = total + math.copysign(1.0, a) * prod ** (1.0 / len(ts))
    want = -total / mask.shape[0]
    for name in ("gmpo", "geo_mean"):
        got, out = _vectorised(name, lp, old, adv, mask, "seq-mean-token-mean", clip_low=clip_low, clip_high=clip_high)
        _close(got, want)
        _close(_grad(got, lp), _grad(want, lp))
    assert out.clipped.any()


def test_gmpo_token_advantages_use_their_mean_and_sign_per_token():
    """With token-level advantages (outside the paper) A_i is their mean and each token is clipped
    by the sign of its own advantage, as verl's geo_mean."""
    lp, old, adv, mask = _inputs(3, scale=0.5)
    lp = lp.requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        a_i = sum(float(adv[i, t]) for t in ts) / len(ts)
        s = torch.zeros((), dtype=D)
        for t in ts:
            lr, sgn = lp[i, t] - old[i, t], float(torch.sign(adv[i, t]))
            s = s + sgn * torch.minimum(sgn * lr, sgn * lr.clamp(-0.2, 0.3))
        total = total - a_i * torch.exp(s / len(ts))
    want = total / mask.shape[0]
    got, _ = _vectorised("gmpo", lp, old, adv, mask, "seq-mean-token-mean", clip_low=0.2, clip_high=0.3)
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_against_loop(seed, tau_pos, tau_neg):
    """SAPO: J = 1/G sum_i 1/|y_i| sum_t f_t(r_t) A_t, f(x) = sigmoid(tau (x - 1)) * 4 / tau,
    tau = tau_pos for A > 0, tau_neg otherwise."""
    lp, old, adv, mask = _inputs(seed, scale=0.8)
    lp = lp.requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for i in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        row = torch.zeros((), dtype=D)
        for t in ts:
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            r = torch.exp(lp[i, t] - old[i, t])
            row = row + 4.0 / tau / (1.0 + torch.exp(-tau * (r - 1.0))) * adv[i, t]
        total = total + row / len(ts)
    want = -total / mask.shape[0]
    got, out = _vectorised("sapo", lp, old, adv, mask, "seq-mean-token-mean", tau_pos=tau_pos, tau_neg=tau_neg)
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))
    assert not out.clipped.any()


def test_sapo_gradient_is_the_policy_gradient_on_policy():
    """At r = 1 the gate's slope is 4 sigma(0)(1 - sigma(0)) = 1: SAPO's gradient is -A grad log pi."""
    lp, _, adv, mask = _inputs(4)
    lp = lp.requires_grad_(True)
    got, _ = _vectorised("sapo", lp, lp.detach(), adv, mask, "token-mean")
    _close(_grad(got, lp), torch.where(mask, -adv, 0.0) / mask.sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_against_loop(seed):
    """GPG: J = 1/sum|o_i| sum_i sum_t A_t log pi_t."""
    lp, old, adv, mask = _inputs(seed)
    lp = lp.requires_grad_(True)
    want = -sum(adv[i, t] * lp[i, t] for i, t in _tokens(mask)) / len(_tokens(mask))
    got, out = _vectorised("gpg", lp, old, adv, mask, "token-mean")
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))
    _close(out.log_ratio, torch.where(mask, lp - old, 0.0).detach())


def _loop_covariance(lp, adv, mask) -> dict:
    toks = _tokens(mask)
    mean_a = sum(float(adv[i, t]) for i, t in toks) / len(toks)
    lp = lp.detach()
    mean_lp = sum(float(lp[i, t]) for i, t in toks) / len(toks)
    return {(i, t): (float(adv[i, t]) - mean_a) * (float(lp[i, t]) - mean_lp) for i, t in toks}


def _loop_ppo(lp, old, adv, i, t, clip_low, clip_high):
    r = torch.exp(lp[i, t] - old[i, t])
    return -torch.minimum(r * adv[i, t], r.clamp(1 - clip_low, 1 + clip_high) * adv[i, t])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_against_loop_when_every_candidate_is_detached(seed):
    """Clip-Cov: tokens with lb < Cov < ub (and unclipped by PPO) are candidates; with a ratio
    that picks all of them, each candidate's term is 0 (gradient detached), the rest PPO's."""
    lp, old, adv, mask = _inputs(seed, B=5, T=8, adv_scale=2.0, scale=0.2)
    lp = lp.requires_grad_(True)
    kw = dict(clip_low=0.2, clip_high=0.2, clip_cov_ratio=0.9, clip_cov_lb=0.3, clip_cov_ub=4.0)
    cov = _loop_covariance(lp, adv, mask)
    total, n_cand = torch.zeros((), dtype=D), 0
    for i, t in _tokens(mask):
        term = _loop_ppo(lp, old, adv, i, t, 0.2, 0.2)
        r, a = math.exp(float(lp[i, t].detach() - old[i, t])), float(adv[i, t])
        ppo_clipped = min(max(r, 0.8), 1.2) * a < r * a  # PPO's clipped branch is the active one
        if 0.3 < cov[(i, t)] < 4.0 and not ppo_clipped:
            n_cand += 1
            continue
        total = total + term
    want = total / len(_tokens(mask))
    assert 0 < n_cand <= int(0.9 * len(_tokens(mask)))
    got, out = _vectorised("clip_cov", lp, old, adv, mask, "token-mean", **kw)
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))


def test_clip_cov_random_pick_is_a_reproducible_subset_of_the_candidates():
    lp, old, adv, mask = _inputs(5, B=6, T=10, adv_scale=2.0, scale=0.2)
    kw = dict(clip_low=0.2, clip_high=0.2, clip_cov_ratio=0.05, clip_cov_lb=0.3, clip_cov_ub=6.0)
    base = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    cov = _loop_covariance(lp, adv, mask)
    cand = {k for k, c in cov.items() if 0.3 < c < 6.0 and not base.clipped[k]}
    n_pick = max(int(0.05 * int(mask.sum())), 1)
    assert len(cand) > n_pick  # a real random choice
    out = POLICY_LOSSES["clip_cov"](lp, old, adv, mask, **kw)
    picked = {(i, t) for i, t in _tokens(mask) if out.clipped[i, t] and not base.clipped[i, t]}
    assert len(picked) == n_pick and picked <= cand
    assert all(out.token_loss[k] == 0 for k in picked)
    again = POLICY_LOSSES["clip_cov"](lp, old, adv, mask, **kw)
    assert torch.equal(again.clipped, out.clipped)
    other = [k for k in cand if k not in picked]
    assert all(out.token_loss[k] == base.token_loss[k] for k in other)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ratio, coef", [(0.1, 1.0), (0.3, 0.1)])
def test_kl_cov_against_loop(seed, ratio, coef):
    """KL-Cov: the floor(k N) tokens of largest Cov get -r A + beta |log r|, the others -r A."""
    lp, old, adv, mask = _inputs(seed, B=5, T=8)
    lp = lp.requires_grad_(True)
    cov = _loop_covariance(lp, adv, mask)
    k = max(1, int(len(cov) * ratio))
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    total = torch.zeros((), dtype=D)
    for i, t in _tokens(mask):
        lr = lp[i, t] - old[i, t]
        total = total - torch.exp(lr) * adv[i, t] + (coef * lr.abs() if (i, t) in top else 0.0)
    want = total / len(cov)
    got, out = _vectorised("kl_cov", lp, old, adv, mask, "token-mean", kl_cov_ratio=ratio, ppo_kl_coef=coef)
    _close(got, want)
    _close(_grad(got, lp), _grad(want, lp))
    assert {k for k in _tokens(mask) if out.clipped[k]} == top


@pytest.mark.parametrize("name", NEW)
def test_masked_positions_and_weights(name):
    """Garbage at masked positions changes nothing; weights multiply each token's loss."""
    lp, old, adv, mask = _inputs(6, seq_adv=True)
    out = POLICY_LOSSES[name](lp, old, adv, mask)
    lp2, adv2 = lp.clone(), adv.clone()
    lp2[~mask], adv2[~mask] = -1e3, 1e3
    out2 = POLICY_LOSSES[name](lp2, old, adv2, mask)
    _close(out2.token_loss, out.token_loss)
    assert (out.token_loss[~mask] == 0).all() and not out.clipped[~mask].any()
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    _close(POLICY_LOSSES[name](lp, old, adv, mask, w).token_loss, out.token_loss * w)
    with pytest.raises(ValueError, match="shape"):
        POLICY_LOSSES[name](lp, old, adv, mask, w[:, :-1])


@pytest.mark.parametrize("name", ["cispo", "gmpo", "sapo", "gpg"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_mini_batch(name, agg):
    """Each sequence's loss is its own (``batch_dependent`` False): micro-batches of 3, 3, 2
    sequences, given the mini-batch's counts, sum to the mini-batch's loss and gradient."""
    lp, old, adv, mask = _inputs(8, B=8, T=6, seq_adv=True)
    totals = {"num_tokens": int(mask.sum()), "num_sequences": 8, "norm_tokens": 6}
    full_lp = lp.clone().requires_grad_(True)
    full = LOSS_AGGREGATIONS[agg](POLICY_LOSSES[name](full_lp, old, adv, mask).token_loss, mask, **totals)
    micro_lp, acc = lp.clone().requires_grad_(True), torch.zeros((), dtype=D)
    for s in range(0, 8, 3):
        sl = slice(s, s + 3)
        acc = acc + LOSS_AGGREGATIONS[agg](POLICY_LOSSES[name](micro_lp[sl], old[sl], adv[sl], mask[sl]).token_loss,
                                           mask[sl], **totals)
    _close(acc, full, 1e-12)
    _close(_grad(acc, micro_lp), _grad(full, full_lp), 1e-12)
    assert not POLICY_LOSSES.info(name).batch_dependent


@pytest.mark.parametrize("name, kwargs, match", [
    ("cispo", {"clip_high": -0.1}, "cispo"), ("cispo", {"clip_low": -1.0}, "cispo"),
    ("gmpo", {"clip_low": -0.1}, "gmpo"), ("sapo", {"tau_neg": 0.0}, "sapo"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio"), ("clip_cov", {"clip_cov_lb": 5.0}, "clip_cov_lb"),
    ("clip_cov", {"clip_low": 1.5}, "clip_low"), ("kl_cov", {"kl_cov_ratio": 2.0}, "kl_cov_ratio"),
    ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef"),
])
def test_invalid_parameters_are_refused(name, kwargs, match):
    lp, old, adv, mask = _inputs(0)
    with pytest.raises(ValueError, match=match):
        POLICY_LOSSES[name](lp, old, adv, mask, **kwargs)


# ---------------------------------------------------------------- verl's own numbers


def _verl_cases() -> list[dict]:
    return json.loads(DATA.read_text())["cases"]


def test_verl_data_records_its_source():
    payload = json.loads(DATA.read_text())
    assert len(payload["verl_commit"]) == 40 and payload["dtype"] == "float64"
    assert {c["loss"] for c in payload["cases"]} == set(NEW)


@pytest.mark.parametrize("case", _verl_cases(), ids=lambda c: c["case"])
def test_matches_verl(case):
    """Our loss aggregated with verl's loss_agg_mode gives verl's value and gradient."""
    data = {k: torch.tensor(v, dtype=torch.bool if k == "response_mask" else D) for k, v in case["inputs"].items()}
    lp = data["log_prob"].clone().requires_grad_(True)
    mask = data["response_mask"]
    # every required aggregation is the one verl's function applies itself
    check_policy_loss_aggregation(case["loss"], case["loss_agg_mode"])
    out = POLICY_LOSSES[case["loss"]](lp, data["old_log_prob"], data["advantages"], mask,
                                      data.get("rollout_is_weights"), **case["kwargs"])
    got = LOSS_AGGREGATIONS[case["loss_agg_mode"]](out.token_loss, mask)
    _close(got, torch.tensor(case["verl_loss"], dtype=D), 1e-12)
    _close(_grad(got, lp), torch.tensor(case["verl_grad_log_prob"], dtype=D), 1e-12)


# ---------------------------------------------------------------- config and update wiring


@pytest.mark.parametrize("name", NEW)
def test_config_name_reaches_the_registry(name):
    cfg = load_config(None, [f"update.policy_loss.name={name}"])
    assert cfg.update.policy_loss.name == name
    info = POLICY_LOSSES.info(name)
    assert cfg.update.loss_agg == (info.required_loss_agg or "token-mean")
    assert info.batch_dependent == (name in ("clip_cov", "kl_cov"))
    lp, old, adv, mask = _inputs(0, seq_adv=True)
    out = POLICY_LOSSES[cfg.update.policy_loss.name](lp, old, adv, mask, **policy_loss_kwargs(cfg.update.policy_loss))
    assert torch.isfinite(out.token_loss).all()


def test_geo_mean_is_gmpo():
    assert POLICY_LOSSES["geo_mean"] is POLICY_LOSSES["gmpo"]
    a = load_config(None, ["update.policy_loss.name=geo_mean", "update.policy_loss.clip_high=0.3"]).update
    b = load_config(None, ["update.policy_loss.name=gmpo", "update.policy_loss.clip_high=0.3"]).update
    assert policy_loss_kwargs(a.policy_loss) == policy_loss_kwargs(b.policy_loss) == {"clip_low": 0.4, "clip_high": 0.3}


@pytest.mark.parametrize("overrides, match", [
    (["update.policy_loss.name=gmpo", "update.loss_agg=token-mean"], "seq-mean-token-mean"),
    (["update.policy_loss.name=sapo", "update.loss_agg=seq-mean-token-sum"], "seq-mean-token-mean"),
    (["update.policy_loss.name=sapo", "update.policy_loss.tau_pos=0"], "tau_pos"),
    (["update.policy_loss.name=cispo", "update.policy_loss.clip_high=-1"], "clip_high"),
    (["update.policy_loss.name=gmpo", "update.policy_loss.clip_low=-0.1"], "clip_low"),
    (["update.policy_loss.name=gpg", "update.policy_loss.clip_low=0.2"], "clip_low"),
    (["update.policy_loss.name=clip_cov", "update.policy_loss.clip_cov_lb=6"], "clip_cov_lb"),
    (["update.policy_loss.name=clip_cov", "update.policy_loss.clip_cov_ratio=0"], "clip_cov_ratio"),
    (["update.policy_loss.name=kl_cov", "update.policy_loss.kl_cov_ratio=1.5"], "kl_cov_ratio"),
    (["update.policy_loss.name=kl_cov", "update.policy_loss.ppo_kl_coef=-1"], "ppo_kl_coef"),
])
def test_config_refuses_invalid_parameters(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def _update_data(tiny_model: str):
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.logprobs import batched_response_logprobs
    from rft_core.training.update import UpdateData

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    now = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    old = [[v + 0.3 * math.sin(7 * i + t) for t, v in enumerate(row)] for i, row in enumerate(now)]  # off-policy
    adv = [[a] * len(r) for a, r in zip((1.0, -1.0, 0.5, -0.7), responses)]
    return UpdateData(prompts=prompts, responses=responses, old_logprobs=old, advantages=adv)


def test_ppo_update_with_gmpo_has_the_loop_gradient(tiny_model):
    """ppo_update (micro-batches of 2) with update.policy_loss.name=gmpo: the gradient of the
    paper's objective, computed by a float64 loop over the model's log-probs."""
    from rft_core.models.loading import load_causal_lm
    from rft_core.training.update import ppo_update
    from tests.update_settings import update_settings

    data = _update_data(tiny_model)
    upd = load_config(None, ["update.policy_loss.name=gmpo", "update.policy_loss.clip_low=0.1",
                             "update.policy_loss.clip_high=0.1"]).update
    strategy = GradRecorder(load_causal_lm(tiny_model, trainable=True))
    steps = ppo_update(strategy, data, update_settings(policy_loss=upd.policy_loss, loss_agg=upd.loss_agg,
                                                       micro_batch_size=2), pad_token_id=2)
    assert len(strategy.grads) == 1 and steps[0].clip_frac > 0
    model = load_causal_lm(tiny_model, trainable=True).double()
    total = torch.zeros((), dtype=D)
    for p, r, old, adv in zip(data.prompts, data.responses, data.old_logprobs, data.advantages):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        prod = torch.ones((), dtype=D)
        for t in range(len(r)):
            rho = torch.exp(lp[t] - old[t])
            prod = prod * torch.minimum(rho * adv[t], rho.clamp(math.exp(-0.1), math.exp(0.1)) * adv[t]).abs()
        total = total - math.copysign(1.0, adv[0]) * prod ** (1.0 / len(r))
    (total / len(data.prompts)).backward()
    want = {n: q.grad.float() for n, q in model.named_parameters() if q.grad is not None}
    norm = max(float(w.abs().max()) for w in want.values())
    assert norm > 1e-4
    for name in want:
        torch.testing.assert_close(strategy.grads[0][name], want[name], atol=2e-5 * norm, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gpg", "clip_cov", "kl_cov"])
def test_ppo_update_runs_each_new_loss(tiny_model, name):
    from rft_core.models.loading import load_causal_lm
    from rft_core.training.update import ppo_update
    from tests.update_settings import update_settings

    upd = load_config(None, [f"update.policy_loss.name={name}"]).update
    strategy = GradRecorder(load_causal_lm(tiny_model, trainable=True))
    steps = ppo_update(strategy, _update_data(tiny_model), update_settings(policy_loss=upd.policy_loss, loss_agg=upd.loss_agg, micro_batch_size=2), pad_token_id=2)
    assert len(steps) == 1 and math.isfinite(steps[0].policy_loss) and steps[0].num_tokens == 14
    grads = strategy.grads[0]
    assert all(torch.isfinite(g).all() for g in grads.values()) and any(g.abs().max() > 0 for g in grads.values())
