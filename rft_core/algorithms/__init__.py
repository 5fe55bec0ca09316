"""Pure RL math: advantage estimators, policy losses, KL estimators, masked reductions,
rollout/trainer mismatch correction (importance weights and rejection masks)."""
from rft_core.algorithms.advantages import ADVANTAGE_ESTIMATORS, EstimatorInfo, kl_penalized_outcome_advantages
from rft_core.algorithms.correction import REJECTION_MASKS, ROLLOUT_CORRECTIONS, RolloutCorrection, rollout_correction
from rft_core.algorithms.kl import (
    KL_ESTIMATORS,
    KLEstimatorInfo,
    check_kl_loss_estimator,
    cpgd_policy_drift,
    kl_penalty,
)
from rft_core.algorithms.masked import masked_mean, masked_sum, masked_whiten
from rft_core.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossInfo,
    PolicyLossOutput,
    check_policy_loss_aggregation,
)
from rft_core.algorithms.shaping import overlong_filter_mask
from rft_core.algorithms import baselines, covariance_losses  # noqa: F401,E402  (register pass_at_k ... and clip_cov, kl_cov)
from rft_core.algorithms import divergence_losses, group_estimators  # noqa: F401,E402  (register dppo_*, gpg, gdpo)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REJECTION_MASKS",
    "ROLLOUT_CORRECTIONS",
    "EstimatorInfo",
    "KLEstimatorInfo",
    "PolicyLossInfo",
    "PolicyLossOutput",
    "RolloutCorrection",
    "check_kl_loss_estimator",
    "check_policy_loss_aggregation",
    "cpgd_policy_drift",
    "kl_penalized_outcome_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_filter_mask",
    "rollout_correction",
]
