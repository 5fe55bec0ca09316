"""Pure RL math: advantage estimators, policy losses, KL estimators, masked reductions."""
from rft_core.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rft_core.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rft_core.algorithms.masked import masked_mean, masked_sum, masked_whiten
from rft_core.algorithms.policy_loss import POLICY_LOSSES, PolicyLossOutput

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
]
