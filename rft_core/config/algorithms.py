"""Algorithm configs: KL regularisation, advantage estimators, shaping, dynamic sampling, the
state carried between iterations, and policy losses (each a tagged union on its name)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rft_core.algorithms import KL_ESTIMATORS
from rft_core.config._base import _check_name, _Frozen, _tagged_union


class KLConfig(_Frozen):
    """KL regularisation against the reference model (none when kl_coef is 0)."""

    kl_coef: float = Field(0.0, ge=0, description="initial coefficient")
    estimator: str = "k1"
    mode: Literal["reward", "loss"] = "reward"
    kl_clamp: float = Field(10.0, gt=0)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float | None = Field(None, gt=0, description="adaptive: target KL per sequence (nats)")
    horizon: int = Field(10_000, gt=0, description="adaptive: samples over which the error is corrected")

    @model_validator(mode="after")
    def _check_adaptive(self) -> "KLConfig":
        if self.controller == "adaptive" and self.target is None:
            raise ValueError("kl.controller=adaptive needs kl.target")
        return self

    _v = field_validator("estimator")(lambda cls, v: _check_name(KL_ESTIMATORS, v))

    @property
    def needs_reference(self) -> bool:
        """True when the reference log-prob stage must run."""
        return self.kl_coef > 0

    @property
    def in_reward(self) -> bool:
        """True when the KL penalty is subtracted from the rewards (advantage stage)."""
        return self.mode == "reward" and self.kl_coef > 0

    @property
    def in_loss(self) -> bool:
        """True when the KL is a term of the update's loss (the update reads ref_logprobs)."""
        return self.mode == "loss" and self.kl_coef > 0


class GRPOAdvantage(_Frozen):
    """GRPO / group_norm: (r - group mean) / (group std + eps)."""

    estimator: Literal["grpo", "group_norm"] = "grpo"
    scale_by_std: bool = True
    eps: float = Field(1e-6, gt=0)


class DrGRPOAdvantage(_Frozen):
    """Dr. GRPO: r - group mean (pair with update.loss_agg=seq-mean-token-sum-norm)."""

    estimator: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantage(_Frozen):
    """RLOO: r minus the mean of the other samples of the group."""

    estimator: Literal["rloo"] = "rloo"


class ReinforceAdvantage(_Frozen):
    """REINFORCE++: discounted return of the (KL-shaped) token rewards, batch-whitened."""

    estimator: Literal["reinforce"] = "reinforce"
    gamma: float = Field(1.0, ge=0, le=1)
    whiten: bool = True
    eps: float = Field(1e-8, gt=0)


class ReinforceBaselineAdvantage(_Frozen):
    """REINFORCE++-baseline: group-mean baseline, gamma 1, batch-whitened."""

    estimator: Literal["reinforce_baseline"] = "reinforce_baseline"
    whiten: bool = True
    eps: float = Field(1e-8, gt=0)


class CPGDAdvantage(_Frozen):
    """CPGD: group-normalised summed token rewards (population std), returns = advantages."""

    estimator: Literal["cpgd"] = "cpgd"
    weight_factor: Literal["std", "clip_filter_like", "mean"] = "std"
    eps: float = Field(1e-6, gt=0)
    clip_eps: float = Field(3.0, gt=0)
    lamda: float = Field(1.0, ge=0)


class GAEAdvantage(_Frozen):
    """GAE with a critic (needs the critic stage)."""

    estimator: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)


ADVANTAGE_CONFIGS = (GRPOAdvantage, DrGRPOAdvantage, RLOOAdvantage, ReinforceAdvantage, ReinforceBaselineAdvantage,
                     CPGDAdvantage, GAEAdvantage)
AdvantageConfig = _tagged_union(ADVANTAGE_CONFIGS, "estimator", "grpo", "advantage estimator")


def estimator_kwargs(cfg: "AdvantageConfig") -> dict[str, Any]:
    """The keyword arguments of the chosen estimator function (every field but its name)."""
    return cfg.model_dump(exclude={"estimator"})


class ShapingConfig(_Frozen):
    """Reward and advantage shaping, applied in the order of ``rft_core.algorithms.shaping``."""

    overlong_buffer_len: int | None = Field(None, gt=0, description="DAPO soft overlong penalty over the last N tokens of max_new_tokens")
    overlong_penalty_factor: float = Field(1.0, ge=0)
    reward_running_norm: bool = False
    reward_running_norm_minus_mean: bool = True
    reward_clip: float | None = Field(None, gt=0)
    advantage_whiten: bool = Field(False, description="whiten advantages over the whole rollout (cross-batch normalisation)")
    advantage_clip: float | None = Field(None, gt=0)
    clip_filter_like_weight: bool = Field(False, description="scale advantages by clip_filter_like_weights (flat groups get lamda)")
    clip_filter_like_clip_eps: float = Field(3.0, gt=0)
    clip_filter_like_lamda: float = Field(1.0, ge=0)


class DynamicSamplingConfig(_Frozen):
    """Dynamic sampling (DAPO, arXiv:2503.14476 sec. 3.2): drop groups whose rewards are all
    equal (no GRPO signal) and refill with new prompts until the batch is full."""

    enabled: bool = False
    max_refills: int = Field(3, ge=0, description="extra rollout attempts per iteration at most")


class TrainState(_Frozen):
    """What one iteration hands to the next besides the policy: the KL coefficient and the
    running reward statistics. Stored in each advantages manifest (``next_state``), so a
    resumed run continues with exactly the same values."""

    kl_coef: float = Field(0.0, ge=0)
    reward_count: int = Field(0, ge=0)
    reward_mean: float = 0.0
    reward_m2: float = Field(0.0, ge=0)


class PPOClipLoss(_Frozen):
    """PPO clipped surrogate; clip_high > clip_low is DAPO's clip-higher."""

    name: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0)


class DualClipLoss(_Frozen):
    """Dual-clip PPO: also caps the loss of negative-advantage tokens at -clip_c * A."""

    name: Literal["dual_clip"] = "dual_clip"
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0)
    clip_c: float = Field(3.0, gt=1)


class GSPOLoss(_Frozen):
    """GSPO: sequence-level (geometric mean) ratio with a tiny clip range."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1)
    clip_high: float = Field(4e-4, ge=0)


class CPGDLoss(_Frozen):
    """CPGD: clipped log-ratio objective."""

    name: Literal["cpgd"] = "cpgd"
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0)


POLICY_LOSS_CONFIGS = (PPOClipLoss, DualClipLoss, GSPOLoss, CPGDLoss)


PolicyLossConfig = _tagged_union(POLICY_LOSS_CONFIGS, "name", "ppo_clip", "policy loss")



def policy_loss_kwargs(cfg: "PolicyLossConfig") -> dict[str, Any]:
    """The keyword arguments of the chosen policy loss function (every field but its name)."""
    return cfg.model_dump(exclude={"name"})
