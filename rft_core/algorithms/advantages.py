"""Advantage estimators, chosen by name from ``ADVANTAGE_ESTIMATORS``.

Each estimator takes tensors and keyword-only scalars and returns ``(advantages, returns)``,
both (B, T) float, zero where ``action_mask`` is False.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rft_core.algorithms.masked import masked_whiten
from rft_core.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@dataclass(frozen=True)
class EstimatorInfo:
    """What a caller must know about an advantage estimator without calling it
    (``ADVANTAGE_ESTIMATORS.info(name)``).

    Attributes:
        token_level: it takes per-token rewards (keyword ``token_rewards``, (B, T)): a reward-mode
            KL penalty goes on each token (``kl_shaped_token_rewards``). False: it works on one
            scalar per sample, (B,).
        needs_critic: it takes critic values (keyword ``values``, (B, T)): the critic stages run.
        group_baseline: it subtracts a statistic of the sample's own group (prompt), so a group
            whose outcome rewards are all equal (and with no per-token KL penalty) gets zero
            advantages. False for estimators that only whiten over the batch or use a critic.
        greedy_baseline: it takes the reward of one greedy (argmax) response of the sample's
            prompt as its baseline (keyword ``reward_baselines``, (B,); ReMax): the iteration
            generates that response (the rollout stage with ``greedy``, stage folder
            ``baseline_rollout``) and scores it (``baseline_rewards``).
        needs_sum_pi_squared: it takes the policy's statistics at every response token
            (keywords ``old_logprobs`` and ``sum_pi_squared``, (B, T) each: log pi_old of the
            sampled token and sum_v pi_old(v)^2, both from the actor stage, and
            ``rollout_is_weights``, the rollout correction's weights or None; the optimal token
            baseline): the actor stage runs and writes ``sum_pi_squared``.
        needs_reward_sources: it takes the score of each reward source separately (keyword
            ``source_rewards``: source name -> (B,) float, NaN where a sample's recipe has no such
            source; GDPO), read from the rewards shard's ``reward_metrics``.
    """

    token_level: bool
    needs_critic: bool
    group_baseline: bool
    greedy_baseline: bool = False
    needs_sum_pi_squared: bool = False
    needs_reward_sources: bool = False


_OUTCOME_GROUP = EstimatorInfo(token_level=False, needs_critic=False, group_baseline=True)


def group_stats(values: torch.Tensor, group_ids: torch.Tensor, *, unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and group std (unbiased, or the population std with ``unbiased=False``).

    Args:
        values: (B,) float.
        group_ids: (B,) int, samples of one prompt share an id (any integers, any order).
    Returns:
        (mean, std), each (B,): the statistic of the sample's own group. A group of one sample
        has std 0 (the unbiased estimate is undefined there).
    """
    if values.shape != group_ids.shape or values.dim() != 1:
        raise ValueError(
            f"values and group_ids must both be (B,), got {tuple(values.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups).to(values.dtype)
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    mean = sums / counts
    centered = values - mean[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, centered**2)
    denom = (counts - 1).clamp(min=1) if unbiased else counts
    var = torch.where(counts > 1, sq / denom, torch.zeros_like(sq))
    return mean[inverse], var.sqrt()[inverse]


def clip_filter_like_weights(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, clip_eps: float = 3.0, lamda: float = 1.0
) -> torch.Tensor:
    """Per-sample weights that make up for groups without signal (LightRFT's clip-filter-like weight).

    A group whose rewards are all equal (std 0, no GRPO signal) gets weight ``lamda``; every
    other group gets min(P / (P - P0), clip_eps), with P groups of which P0 are flat, so the
    groups with signal carry the weight of the flat ones. All groups flat: every weight is 1.

    Args:
        rewards: (B,) float; group_ids: (B,) int.
    Returns:
        (B,) weights, same dtype as rewards.
    """
    _, std = group_stats(rewards, group_ids, unbiased=False)
    flat = std == 0
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = len(uniq)
    flat_groups = int(torch.zeros(n_groups, dtype=torch.bool).index_fill_(0, inverse[flat], True).sum()) if flat.any() else 0
    if flat_groups == n_groups:
        return torch.ones_like(rewards)
    w = min(n_groups / (n_groups - flat_groups), clip_eps)
    return torch.where(flat, torch.full_like(rewards, lamda), torch.full_like(rewards, w))


@ADVANTAGE_ESTIMATORS.register("grpo", "group_norm", info=_OUTCOME_GROUP)
def group_normalized_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps), std unbiased (Bessel), broadcast over the
    response tokens of sample i. With ``scale_by_std=False`` it is r_i - mean_g(r)
    (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).

    Args:
        rewards: (B,) float, one scalar reward per sample (any KL penalty already applied).
        group_ids: (B,) int, samples of one prompt share an id.
        action_mask: (B, T) bool.
    Returns:
        (advantages, returns): (B, T) each, zero where action_mask is False. For an outcome
        reward with gamma = 1, returns are the reward broadcast over the response.
    """
    mean, std = group_stats(rewards, group_ids)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (std + eps)
    zeros = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    advantages = torch.where(action_mask, adv[:, None], zeros)
    returns = torch.where(action_mask, rewards[:, None], zeros)
    return advantages, returns


def kl_penalized_outcome_advantages(
    estimator: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl: torch.Tensor,
    kl_coef: float,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **estimator_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An outcome estimator's advantages with the reward-mode KL penalty applied after the
    group statistics: A_i = estimator(r)_i - kl_coef * sum_t k_{i,t}, broadcast over the response.

    The penalty is not put in the reward before group normalisation: with equal task rewards in
    a group, (r - kl_coef * sum_t k) differs only by the tiny KL sums, and dividing by their
    std blows those differences up to advantages of magnitude ~1 whatever kl_coef is. Applied
    after, the KL term keeps its scale kl_coef * sum_t k_{i,t} (the regulariser of the
    KL-penalised objective E[r] - kl_coef * KL, Ouyang et al. 2022, arXiv:2203.02155, eq. 2, at
    sequence level; Shao et al. 2024, arXiv:2402.03300, sec. 4.1 keep the KL out of the
    normalised advantage too, as a loss term).

    Args:
        estimator: a name in ``ADVANTAGE_ESTIMATORS`` whose info has ``token_level`` False.
        rewards: (B,) float task rewards (shaped by overlong penalty / clipping as configured,
            without any KL).
        group_ids: (B,) int; action_mask: (B, T) bool.
        kl: (B, T) per-token KL estimates k_{i,t} (zero where masked), e.g. ``kl_penalty``.
        kl_coef: >= 0.
        transform: optional map of the estimator's (B, T) advantages applied before the penalty
            is subtracted (the advantage shaping steps, e.g. clip-filter-like weights and
            whitening), so that no shaping step can rescale the KL term: a group with equal task
            rewards keeps |A_i| = kl_coef * |sum_t k_{i,t}| whatever the steps.
        estimator_kwargs: the estimator's own keywords (e.g. ``scale_by_std``).
    Returns:
        (advantages, returns), (B, T) each, zero where masked; returns = (r_i - kl_coef *
        sum_t k_{i,t}) broadcast (the KL-penalised outcome).
    Raises:
        UnknownNameError: unknown estimator.
        ValueError: a token-level estimator (it takes the penalty per token, through
            ``kl_shaped_token_rewards``), kl_coef < 0, kl of another shape than action_mask, or
            a ``transform`` that changes the shape.
    """
    info = ADVANTAGE_ESTIMATORS.info(estimator)
    if info.token_level:
        raise ValueError(f"advantage estimator {estimator!r} is token-level: give it the KL penalty per token "
                         f"(kl_shaped_token_rewards), not after normalisation")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl.shape != action_mask.shape:
        raise ValueError(f"kl must have action_mask's shape {tuple(action_mask.shape)}, got {tuple(kl.shape)}")
    penalty = kl_coef * torch.where(action_mask, kl.to(rewards.dtype), _zeros_like_mask(action_mask, rewards.dtype)).sum(-1)
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](rewards, group_ids, action_mask, **estimator_kwargs)
    if transform is not None:
        adv = transform(adv)
        if adv.shape != action_mask.shape:
            raise ValueError(f"transform must keep the advantages' shape {tuple(action_mask.shape)}, got {tuple(adv.shape)}")
    return adv - _broadcast(penalty, action_mask), _broadcast(rewards - penalty, action_mask)


def _zeros_like_mask(action_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(action_mask.shape, dtype=dtype, device=action_mask.device)


def last_token_index(action_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last True of each row of ``action_mask`` (-1 for an all-False row)."""
    T = action_mask.shape[1]
    idx = torch.arange(T, device=action_mask.device).expand_as(action_mask)
    return torch.where(action_mask, idx, torch.full_like(idx, -1)).max(dim=1).values


def kl_shaped_token_rewards(
    rewards: torch.Tensor, kl: torch.Tensor, action_mask: torch.Tensor, *, kl_coef: float
) -> torch.Tensor:
    """Token rewards with a per-token KL penalty (Ouyang et al. 2022, arXiv:2203.02155, eq. 2;
    REINFORCE++, Hu 2025, arXiv:2501.03262, sec. 3).

    r_t = -kl_coef * kl_t for every response token, plus the outcome reward on the last one.
    Sum over t equals rewards - kl_coef * sum_t kl_t. All-masked rows are all zero.

    Args:
        rewards: (B,) outcome rewards.
        kl: (B, T) per-token KL estimates (zero where masked).
        action_mask: (B, T) bool.
    Returns:
        (B, T) token rewards, zero where action_mask is False.
    """
    out = torch.where(action_mask, -kl_coef * kl.to(rewards.dtype), _zeros_like_mask(action_mask, rewards.dtype))
    last = last_token_index(action_mask)
    rows = torch.nonzero(last >= 0).flatten()
    out[rows, last[rows]] += rewards[rows]
    return out


def discounted_returns(token_rewards: torch.Tensor, action_mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t, k unmasked} gamma^(n(t, k)) r_k, the reverse discounted cumulative sum
    over the action tokens, n(t, k) = the number of unmasked positions in (t, k].

    The discount counts actions, not positions: a masked position inside a response (an
    observation token of a multi-turn row, action_mask False there) neither discounts nor resets
    the return; it passes G through to the action before it and gets G = 0 itself. This is the
    rule of verl's ``compute_gae_advantage_return`` ("skip values and TD-error on observation
    tokens", ``verl/trainer/ppo/core_algos.py``), here for the returns of REINFORCE++ (Hu 2025,
    arXiv:2501.03262, sec. 3: G_t = sum_{k >= t} gamma^(k - t) r_k over the model's actions).
    verl's REINFORCE++ returns reset G at a masked position ("Reset after EOS") and OpenRLHF's
    ``get_cumulative_returns`` discounts through it; both agree with this function on
    right-padded rows, the only masks either was written for. (Before issue 29 every position
    counted in the power of gamma.)

    Args:
        token_rewards: (B, T) float.
        action_mask: (B, T) bool.
        gamma: the discount per action token.
    Returns:
        (B, T) returns, 0 where action_mask is False.
    """
    r = torch.where(action_mask, token_rewards, _zeros_like_mask(action_mask, token_rewards.dtype))
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = torch.where(action_mask[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(action_mask, out, torch.zeros_like(out))


def _outcome_token_rewards(rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    return kl_shaped_token_rewards(rewards, _zeros_like_mask(action_mask, rewards.dtype), action_mask, kl_coef=0.0)


def _broadcast(per_seq: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(action_mask, per_seq[:, None], _zeros_like_mask(action_mask, per_seq.dtype))


@ADVANTAGE_ESTIMATORS.register("dr_grpo", info=_OUTCOME_GROUP)
def dr_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantages (Liu et al. 2025, arXiv:2503.20783, sec. 3.2): A_i = r_i - mean_g(r).

    No division by the group std (it biases towards too easy / too hard prompts); pair it with
    ``update.loss_agg=seq-mean-token-sum-norm`` to also drop the length normalisation.
    Shapes as ``group_normalized_advantages``.
    """
    mean, _ = group_stats(rewards, group_ids)
    return _broadcast(rewards - mean, action_mask), _broadcast(rewards, action_mask)


@ADVANTAGE_ESTIMATORS.register("rloo", info=_OUTCOME_GROUP)
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740, eq. 5).

    A_i = r_i - 1/(G-1) sum_{j != i, j in g} r_j = G/(G-1) (r_i - mean_g(r)); a group of one
    sample gets 0. Broadcast over the response tokens.

    Args:
        rewards: (B,) float; group_ids: (B,) int; action_mask: (B, T) bool.
    Returns:
        (advantages, returns), (B, T) each.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups).to(rewards.dtype)
    sums = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    n = counts[inverse]
    baseline = (sums[inverse] - rewards) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, rewards - baseline, torch.zeros_like(rewards))
    return _broadcast(adv, action_mask), _broadcast(rewards, action_mask)


def _whiten_if(adv: torch.Tensor, action_mask: torch.Tensor, whiten: bool, eps: float) -> torch.Tensor:
    return masked_whiten(adv, action_mask, eps=eps) if whiten else adv


@ADVANTAGE_ESTIMATORS.register(
    "reinforce", info=EstimatorInfo(token_level=True, needs_critic=False, group_baseline=False)
)
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, sec. 3): discounted returns of the token rewards,
    whitened over the whole batch (masked mean and unbiased std).

    G_t = sum_{k >= t} gamma^(k-t) r_k;  A_t = (G_t - mean(G)) / sqrt(var(G) + eps).

    Args:
        token_rewards: (B, T), e.g. ``kl_shaped_token_rewards``; default: the outcome reward on
            the last response token.
    Returns:
        (advantages, returns=G), (B, T) each, zero where masked.
    """
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    returns = discounted_returns(tr, action_mask, gamma=gamma)
    return _whiten_if(returns, action_mask, whiten, eps), returns


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_baseline", info=EstimatorInfo(token_level=True, needs_critic=False, group_baseline=True)
)
def reinforce_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262 v2, sec. 3.2): subtract the group-mean
    outcome reward, take the undiscounted (gamma = 1) return, whiten over the batch.

    r'_t = token_rewards_t - 1[t = last] mean_g(r);  G_t = sum_{k >= t} r'_k;  A = whiten(G).

    Returns:
        (advantages, returns=G with the baseline removed), (B, T) each.
    """
    mean, _ = group_stats(rewards, group_ids)
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    tr = tr - _outcome_token_rewards(mean, action_mask)
    returns = discounted_returns(tr, action_mask, gamma=1.0)
    return _whiten_if(returns, action_mask, whiten, eps), returns


@ADVANTAGE_ESTIMATORS.register(
    "gae", info=EstimatorInfo(token_level=True, needs_critic=True, group_baseline=False)
)
def gae_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    values: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    gae_lambda: float = 0.95,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lambda A_{t+1};  returns = A + V.
    V after the last response token is 0 (the episode ends). Values at masked positions are
    replaced by 0 first, so whatever the critic put there cannot leak into the result; a masked
    position inside a response (an observation token) is skipped, as in verl.

    ``whiten`` (default True): A <- (A - mean(A)) / sqrt(var(A) + 1e-8), mean and unbiased var
    over every response token (action_mask True) of the batch the function is given (the
    advantages stage gives it the whole rollout), as verl's ``compute_gae_advantage_return``
    (``verl_F.masked_whiten(advantages, response_mask)``, always on, over the training batch of
    the step) and OpenRLHF's ``compute_advantages_and_returns``
    (``openrlhf/trainer/ppo_utils/experience_maker.py``: mean subtracted and divided by the std
    over all action tokens of the rollout for gae, unless ``--algo.advantage.no_std_norm``; it
    uses the population variance). The returns, the critic's targets, are A + V before
    whitening, in both.

    Args:
        values: (B, T) critic values V(s_t) of the response tokens.
        token_rewards: (B, T); default: the outcome reward on the last response token.
        whiten: whiten the advantages over the batch (``masked_whiten``).
    Returns:
        (advantages, returns), (B, T) each, zero where masked.
    """
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    zeros = _zeros_like_mask(action_mask, values.dtype)
    v = torch.where(action_mask, values, zeros)
    r = torch.where(action_mask, tr.to(values.dtype), zeros)
    adv = torch.zeros_like(v)
    next_adv = torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    next_v = torch.zeros_like(next_adv)
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        cur = delta + gamma * gae_lambda * next_adv
        m = action_mask[:, t]
        adv[:, t] = torch.where(m, cur, torch.zeros_like(cur))
        next_adv = torch.where(m, cur, next_adv)
        next_v = torch.where(m, v[:, t], next_v)
    returns = torch.where(action_mask, adv + v, zeros)
    return _whiten_if(adv, action_mask, whiten, 1e-8), returns


@ADVANTAGE_ESTIMATORS.register("cpgd", info=_OUTCOME_GROUP)
def cpgd_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    token_rewards: torch.Tensor | None = None,
    weight_factor: str = "std",
    eps: float = 1e-6,
    clip_eps: float = 3.0,
    lamda: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPGD advantages (Liu et al. 2025, arXiv:2505.12504; as LightRFT computes them).

    s_i = sum_t token_rewards_i,t (the outcome reward with any per-token KL penalty), then per
    group: ``std``: (s_i - mean_g s) / (std_g s + eps) with the population std;
    ``clip_filter_like``: (s_i - mean_g s) * clip_filter_like_weights; ``mean``: s_i - mean_g s.
    Broadcast over the response; returns equal the advantages. The groups are the prompts of
    the whole rollout, so a group's samples are never split (LightRFT's fast path normalised
    each micro-batch alone, which could zero every advantage).

    Raises:
        ValueError: unknown ``weight_factor``.
    """
    if weight_factor not in ("std", "clip_filter_like", "mean"):
        raise ValueError(f"unknown weight_factor {weight_factor!r}; valid: std, clip_filter_like, mean")
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    scores = torch.where(action_mask, tr, _zeros_like_mask(action_mask, tr.dtype)).sum(-1)
    mean, std = group_stats(scores, group_ids, unbiased=False)
    centred = scores - mean
    if weight_factor == "std":
        adv = centred / (std + eps)
    elif weight_factor == "clip_filter_like":
        adv = centred * clip_filter_like_weights(scores, group_ids, clip_eps=clip_eps, lamda=lamda)
    else:
        adv = centred
    adv = _broadcast(adv, action_mask)
    return adv, adv.clone()
