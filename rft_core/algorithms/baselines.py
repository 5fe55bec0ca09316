"""Advantage estimators whose baseline is not the group's mean and std (issue 29): pass@k's
closed form (Chen et al. 2025, arXiv:2508.10751), OPO's length-weighted baseline (arXiv:2505.23585),
ReMax's greedy response (arXiv:2310.10505) and verl's optimal token baseline. Registered in
``ADVANTAGE_ESTIMATORS`` when ``rft_core.algorithms`` is imported."""
from __future__ import annotations

import torch

from rft_core.algorithms.advantages import (
    _OUTCOME_GROUP,
    ADVANTAGE_ESTIMATORS,
    EstimatorInfo,
    _broadcast,
    _outcome_token_rewards,
    discounted_returns,
)


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(inverse, n_groups): each sample's group as 0..n_groups-1 (``torch.unique`` order)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def _group_sum(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums over the first axis: (n_groups, *values.shape[1:])."""
    out = torch.zeros((n_groups, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, inverse, values)


def _binom_ratio(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """C(a, m) / C(b, m) elementwise for integer-valued float64 a <= b, b >= m >= 0, as the
    product prod_{j<m} (a - j) / (b - j) (no factorials, exact up to rounding for any group
    size); 0 where a < m (C(a, m) = 0 for 0 <= a < m, and by convention for a < 0)."""
    j = torch.arange(m, dtype=a.dtype, device=a.device)
    prod = ((a[:, None] - j) / (b[:, None] - j)).prod(-1)
    return torch.where(a >= m, prod, torch.zeros_like(prod))


@ADVANTAGE_ESTIMATORS.register("pass_at_k", info=_OUTCOME_GROUP)
def pass_at_k_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    k: int = 2,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k Training advantages in closed form (Chen et al. 2025, "Pass@k Training for
    Adaptively Balancing Exploration and Exploitation of Large Reasoning Models",
    arXiv:2508.10751, sec. 4, "analytical derivation").

    A group of n responses with c correct (reward 1) and n_neg = n - c wrong (reward 0) is the
    population of its C(n, k) k-subsets, each rewarded pass@k = max of its rewards:

        R = 1 - C(n_neg, k) / C(n, k)          (mean subset reward)
        sigma = sqrt(R (1 - R))                (std of the binary subset rewards)
        A_pos = (1 - R) / (sigma + eps)
        A_neg = (1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps)

    i.e. each response gets the mean normalised advantage of the subsets it belongs to. k = 1
    is GRPO with the population std; a group with no correct or no wrong response, or with
    n_neg < k (every subset passes), gets 0. k = n gives 0 for every group (a group passes iff
    one response is correct). Broadcast over the response tokens.

    Checked against the authors' ``calc_adv`` (``code/passk_adv.py`` of
    github.com/RUCAIBox/Passk_Training, commit c3ba575e; the same formulas, the same eps added
    to sigma) on committed numbers (``tests/rft_core/algorithms/data/verl_estimators.json``).
    verl has no such estimator (its ``grpo_passk`` is another method, arXiv:2503.19595). Unlike
    ``calc_adv``, which passes a reward other than 0 or 1 through unchanged as the advantage,
    non-binary rewards are refused.

    Args:
        rewards: (B,) float, 1.0 (correct) or 0.0 (wrong) for each sample.
        group_ids: (B,) int, samples of one prompt share an id.
        action_mask: (B, T) bool.
        k: the k of pass@k, 1 <= k <= the size of every group.
        eps: added to sigma (the authors' 1e-6).
    Returns:
        (advantages, returns=the reward broadcast), (B, T) each in the dtype of ``rewards``
        (computed in float64), zero where action_mask is False.
    Raises:
        ValueError: k < 1, a group smaller than k, or a reward other than 0 and 1.
    """
    if k < 1:
        raise ValueError(f"pass_at_k: advantage.k must be >= 1, got {k}")
    binary = (rewards == 0) | (rewards == 1)
    if not bool(binary.all()):
        bad = rewards[~binary][:3].tolist()
        raise ValueError(f"pass_at_k needs binary rewards (1 correct, 0 wrong), got e.g. {bad}: use a 0/1 reward "
                         f"(no format bonus, no shaping.overlong_buffer_len or shaping.reward_running_norm)")
    inverse, n_groups = _group_index(group_ids)
    r64 = rewards.to(torch.float64)
    n = torch.bincount(inverse, minlength=n_groups).to(torch.float64)
    if n_groups and int(n.min()) < k:
        raise ValueError(f"pass_at_k: advantage.k={k} exceeds the group size {int(n.min())} (the samples of one "
                         f"prompt, rollout.n_samples_per_prompt): k must be between 1 and the group size")
    c = _group_sum(r64, inverse, n_groups)
    n_neg = n - c
    mean = 1.0 - _binom_ratio(n_neg, n, k)
    sigma = (mean * (1.0 - mean)).clamp(min=0.0).sqrt()
    a_pos = (1.0 - mean) / (sigma + eps)
    a_neg = (1.0 - mean - _binom_ratio(n_neg - 1.0, n - 1.0, k - 1)) / (sigma + eps)
    adv = torch.where(r64 == 1, a_pos[inverse], a_neg[inverse]).to(rewards.dtype)
    return _broadcast(adv, action_mask), _broadcast(rewards, action_mask)


@ADVANTAGE_ESTIMATORS.register("opo", info=_OUTCOME_GROUP)
def opo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO advantages (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585, the optimal reward baseline): A_i = r_i - b_g with the length-weighted baseline

        b_g = sum_{j in g} l_j r_j / sum_{j in g} l_j,

    l_j the response length (the number of True entries of the row of ``action_mask``: model
    tokens only in a multi-turn row), the paper's approximation of ||grad log pi(y_j)||^2 in
    the variance-minimising baseline E[||grad log pi||^2 r] / E[||grad log pi||^2]. No division
    by a std. A group whose lengths are all 0 takes the plain mean (it has no tokens to train).
    Broadcast over the response tokens.

    Checked against verl's ``compute_opo_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``,
    verl commit b178a3cd) on committed numbers. Deviations: a group of one sample gets A = 0
    here (the formula: b = r), verl sets b = 0 there (A = r); the returns here are the reward
    broadcast (as every outcome estimator of this project), verl returns the advantages.

    Args:
        rewards: (B,) float; group_ids: (B,) int; action_mask: (B, T) bool.
    Returns:
        (advantages, returns), (B, T) each in the dtype of ``rewards``, zero where masked.
    """
    inverse, n_groups = _group_index(group_ids)
    lengths = action_mask.sum(-1).to(rewards.dtype)
    num = _group_sum(lengths * rewards, inverse, n_groups)
    den = _group_sum(lengths, inverse, n_groups)
    counts = torch.bincount(inverse, minlength=n_groups).to(rewards.dtype)
    mean = _group_sum(rewards, inverse, n_groups) / counts.clamp(min=1)
    baseline = torch.where(den > 0, num / den.clamp(min=torch.finfo(rewards.dtype).tiny), mean)
    return _broadcast(rewards - baseline[inverse], action_mask), _broadcast(rewards, action_mask)


@ADVANTAGE_ESTIMATORS.register(
    "remax", info=EstimatorInfo(token_level=True, needs_critic=False, group_baseline=False, greedy_baseline=True)
)
def remax_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantages (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient
    Reinforcement Learning Method for Aligning Large Language Models", arXiv:2310.10505,
    Algorithm 1): the reward of the sampled response minus the reward of the greedy response of
    the same prompt,

        G_t = sum_{k >= t} r_k   (gamma = 1, over the action tokens);   A_t = G_t - r(greedy).

    With outcome token rewards (no per-token KL) A_t = r_i - r(greedy_i) on every response
    token. The greedy response is a function of the prompt alone, so subtracting its reward
    leaves the policy gradient unbiased. Groups play no part (``group_ids`` is unused).

    Checked against verl's ``compute_remax_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``,
    verl commit b178a3cd; ``reward_baselines`` made by ``RayPPOTrainer.fit`` from a
    ``do_sample=False`` generation of every prompt, scored by the same reward function) on
    committed numbers; the same formula. verl leaves the running return at masked positions
    inside a row; here they are 0 (``discounted_returns``), identical on right-padded rows.

    Args:
        rewards: (B,) float outcome rewards of the sampled responses.
        group_ids: (B,) int (unused).
        action_mask: (B, T) bool.
        reward_baselines: (B,) float, the reward of the greedy response of each sample's prompt
            (shaped like ``rewards``, without the KL penalty).
        token_rewards: (B, T), e.g. ``kl_shaped_token_rewards``; default: the outcome reward on
            the last response token.
    Returns:
        (advantages, returns=G), (B, T) each, zero where masked.
    Raises:
        ValueError: ``reward_baselines`` not of the shape of ``rewards``.
    """
    if reward_baselines.shape != rewards.shape:
        raise ValueError(f"remax: reward_baselines must have the rewards' shape {tuple(rewards.shape)}, "
                         f"got {tuple(reward_baselines.shape)}")
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    returns = discounted_returns(tr, action_mask, gamma=1.0)
    return returns - _broadcast(reward_baselines.to(returns.dtype), action_mask), returns


@ADVANTAGE_ESTIMATORS.register(
    "optimal_token_baseline", "tir_optimal_token_baseline",
    info=EstimatorInfo(token_level=True, needs_critic=False, group_baseline=False, needs_sum_pi_squared=True),
)
def optimal_token_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (OTB) advantages, as verl's ``compute_optimal_token_baseline_advantage``
    and, for multi-turn rows, ``compute_multi_turn_optimal_token_baseline_advantage``
    (``tir_optimal_token_baseline``) (``verl/trainer/ppo/core_algos.py``, verl commit 1dda039b;
    ``docs/algo/otb.md`` there, after R. Li's "Optimal Token Baseline" blog post): a baseline per
    group and action-token index k,

        G_k = sum_{j >= k} r_j,   w_k = 1 - 2 pi_k + sum_v pi(v)^2  (x rho_k^2 with IS weights),
        W_k = sum_{j <= k} w_j,
        B_k = sum_{i in g} G_k^i W_k^i / (sum_{i in g} W_k^i + eps),   A_k = G_k - B_k,

    pi_k = exp(old_logprobs) at the k-th action token of a response (the k-th True of its row of
    ``action_mask``); the sums run over the responses of the group that have a k-th action token.
    Indexing by action token is verl's multi-turn form: observation tokens inside a multi-turn
    row (``action_mask`` False) are skipped, so the k-th decision of every response is compared
    with the k-th of the others, whatever the turns in between. On right-padded single-turn rows
    the k-th action token is position k and this is verl's single-turn OTB exactly; both names
    (``optimal_token_baseline``, ``tir_optimal_token_baseline``) reach this function. A group
    with one non-empty response gets B = 0 (A = G); empty responses (no action token) are in no
    group (verl's multi-turn form; its single-turn form counts them).

    ``handle_zero_tail`` (default True, verl's default since verl PR #5380): past the
    second-longest response of a group only the longest has tokens, so B_k = G_k W_k / (W_k + eps)
    ~ G_k and its advantage there would be ~0 whatever its reward; with ``handle_zero_tail`` the
    baseline of the longest response is 0 from the second-longest length on (A = G there, the
    return without a baseline). Applied when one response is strictly the longest of its group
    (lengths in action tokens). So a group whose rewards are all equal gets A = 0 only up to eps
    and outside that tail (``group_baseline`` False).

    w_k is ||grad_logits log pi(a_k)||^2 (the logit-gradient proxy of the squared score norm),
    W_k its running sum.

    ``advantage.estimator=optimal_token_baseline`` (``OptimalTokenBaselineAdvantage``): the
    actor stage writes ``sum_pi_squared`` next to ``old_logprobs`` (``ActorLogprobsInput.
    with_sum_pi_squared``, the same chunked pass, ``rft_core.models.logprobs.token_logprobs``)
    and the advantages stage passes both, with the rollout correction's weights when it is on
    (``AdvantagesInput.rollout_correction``).

    Args:
        rewards: (B,) float outcome rewards.
        group_ids: (B,) int.
        action_mask: (B, T) bool.
        old_logprobs: (B, T) float, log pi_old of the sampled tokens (the actor stage's
            ``old_logprobs``).
        sum_pi_squared: (B, T) float, sum over the vocabulary of pi_old(v)^2 at each position
            (the actor stage's ``sum_pi_squared`` column).
        token_rewards: (B, T); default: the outcome reward on the last response token.
        rollout_is_weights: (B, T) or None, truncated importance weights rho_t (the rollout
            correction's ``weights``, 0 on the tokens it masks).
        handle_zero_tail: zero the baseline of a group's strictly longest response past the
            second-longest length (above).
        eps: added to the denominator (verl's 1e-8).
    Returns:
        (advantages, returns=G), (B, T) each in the dtype of ``old_logprobs``, zero where masked.
    """
    dtype = old_logprobs.dtype
    m = action_mask.to(dtype)
    tr = token_rewards if token_rewards is not None else _outcome_token_rewards(rewards, action_mask)
    returns = discounted_returns(tr.to(dtype), action_mask, gamma=1.0)
    w = 1.0 - 2.0 * old_logprobs.exp() + sum_pi_squared.to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.to(dtype) ** 2
    cum_w = (w * m).cumsum(-1)
    # compact each row to its action tokens: index k = number of action tokens before it
    lengths = action_mask.sum(-1)
    L = int(lengths.max()) if lengths.numel() else 0
    rows, cols = torch.nonzero(action_mask, as_tuple=True)
    k = (action_mask.cumsum(-1) - 1)[rows, cols]
    g_c = returns.new_zeros((len(rewards), max(L, 1)))
    w_c = torch.zeros_like(g_c)
    g_c[rows, k], w_c[rows, k] = returns[rows, cols], cum_w[rows, cols]
    inverse, n_groups = _group_index(group_ids)
    nonempty = lengths > 0
    members = torch.bincount(inverse[nonempty], minlength=n_groups)
    num = _group_sum(g_c * w_c, inverse, n_groups)
    den = _group_sum(w_c, inverse, n_groups) + eps
    baseline = torch.where((members > 1)[:, None], num / den, torch.zeros_like(num))[inverse]
    if handle_zero_tail:
        for g in torch.nonzero(members > 1).flatten().tolist():
            idx = torch.nonzero((inverse == g) & nonempty).flatten()
            lens = lengths[idx]
            top2 = torch.topk(lens, 2).values
            if int((lens == top2[0]).sum()) == 1 and int(top2[0]) > int(top2[1]):
                baseline[idx[int(torch.argmax(lens))], int(top2[1]):] = 0.0
    adv = torch.zeros_like(returns)
    adv[rows, cols] = (g_c - baseline)[rows, k]
    return adv * m, returns
