"""Algorithm configs: KL regularisation, advantage estimators, shaping, dynamic sampling, the
state carried between iterations, and policy losses (each a tagged union on its name)."""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rft_core.algorithms import KL_ESTIMATORS, REJECTION_MASKS, ROLLOUT_CORRECTIONS, check_kl_loss_estimator
from rft_core.algorithms.correction import check_rejection
from rft_core.config._base import _check_name, _Frozen, _tagged_union


# Where the paper of each advantage estimator puts the KL to the reference: the default of
# ``kl.mode`` when it is not given (``TrainConfig`` fills it in). Group-normalised estimators
# put it in the loss (a penalty in the reward would be divided by the group std); the others
# in the reward, per token for the token-level ones.
PAPER_KL_MODE: dict[str, str] = {
    "grpo": "loss",  # Shao et al. 2024, arXiv:2402.03300, eq. 3
    "group_norm": "loss",
    "dr_grpo": "loss",  # Liu et al. 2025, arXiv:2503.20783: GRPO's objective without its length and std terms
    "cpgd": "loss",  # group-normalised like GRPO (Liu et al. 2025, arXiv:2505.12504 has no reference KL of its own)
    "rloo": "reward",  # Ahmadian et al. 2024, arXiv:2402.14740, sec. 3: r - beta * log(pi / pi_ref)
    "reinforce": "reward",  # Hu 2025, arXiv:2501.03262, sec. 3: per-token KL in the reward
    "reinforce_baseline": "reward",  # same paper, sec. 3.2
    "gae": "reward",  # Ouyang et al. 2022, arXiv:2203.02155, eq. 2
    "pass_at_k": "loss",  # Chen et al. 2025, arXiv:2508.10751: GRPO-style group advantages (KL as GRPO's, if any)
    "opo": "loss",  # Hao et al. 2025, arXiv:2505.23585 trains without a KL term; as GRPO's, the method it modifies
    "remax": "reward",  # Li et al. 2023, arXiv:2310.10505 (RLHF reward); verl's remax example: use_kl_in_reward
    # verl's OTB recipe (docs/algo/otb.md, examples/otb_trainer) trains without a KL (use_kl_loss false,
    # use_kl_in_reward false); its input is the token-level rewards (verl's token_level_rewards, which carry the
    # KL with use_kl_in_reward), summed into returns-to-go G_t with no std to rescale a penalty: per token as reinforce
    "optimal_token_baseline": "reward",
    "tir_optimal_token_baseline": "reward",  # the same function (action-token indexing), verl's multi-turn name
    "gpg": "loss",  # Chu et al. 2025, arXiv:2504.02546 trains without a KL or reference; GRPO-style group advantages
    "gdpo": "loss",  # Liu et al. 2026, arXiv:2601.05242: GRPO per reward (its KL as GRPO's, if any)
}
# The estimator used when ``kl.estimator`` is not given, by mode: k1 as a reward (its score-function
# gradient is grad KL(pi||ref)); k3+ as a loss (the value of GRPO's eq. 4 estimator, the gradient
# of the KL(pi||ref) of GRPO's objective, eq. 3; plain k3's loss gradient is grad KL(ref||pi)).
DEFAULT_KL_ESTIMATOR: dict[str, str] = {"reward": "k1", "loss": "k3+"}


class KLConfig(_Frozen):
    """KL regularisation against the reference model (none when kl_coef is 0).

    ``mode``: ``loss`` adds kl_coef * agg(k_t) to the update's loss; ``reward`` subtracts
    kl_coef * k_t from the rewards (per token for token-level estimators; after the group
    normalisation for outcome estimators). Left out of a training config, it is the mode of the
    advantage estimator's paper (``PAPER_KL_MODE``). ``estimator`` left out: ``k3+`` in loss
    mode, ``k1`` in reward mode (``DEFAULT_KL_ESTIMATOR``). An estimator with zero expected
    gradient as a loss term (``k1``) is refused in loss mode when kl_coef > 0
    (``check_kl_loss_estimator``; docs/algorithms.md, "KL").
    """

    kl_coef: float = Field(0.0, ge=0, description="initial coefficient")
    estimator: str = Field("k3+", description="left out: k3+ in loss mode, k1 in reward mode")
    mode: Literal["reward", "loss"] = Field("loss", description="left out in a training config: the advantage estimator's paper's")
    kl_clamp: float = Field(10.0, gt=0)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float | None = Field(None, gt=0, description="adaptive: target KL per sequence (nats)")
    horizon: int = Field(10_000, gt=0, description="adaptive: samples over which the error is corrected")

    @model_validator(mode="before")
    @classmethod
    def _estimator_of_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("estimator") is None and data.get("mode") in DEFAULT_KL_ESTIMATOR:
            data = {**data, "estimator": DEFAULT_KL_ESTIMATOR[data["mode"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> "KLConfig":
        if self.controller == "adaptive" and self.target is None:
            raise ValueError("kl.controller=adaptive needs kl.target")
        if self.mode == "loss" and self.kl_coef > 0:
            try:
                check_kl_loss_estimator(self.estimator)
            except ValueError as exc:
                loss_mode = ", ".join(k for k, v in PAPER_KL_MODE.items() if v == "loss")
                raise ValueError(f"{exc} kl.mode, when left out, is the advantage estimator's paper's: loss for "
                                 f"{loss_mode}.") from None
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
    """GAE with a critic (needs the critic stage); advantages whitened over the rollout's response
    tokens by default, as verl (``compute_gae_advantage_return``) and OpenRLHF do."""

    estimator: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    whiten: bool = Field(True, description="(A - mean) / sqrt(var + 1e-8) over every response token of the rollout "
                         "(verl, OpenRLHF); the returns stay unwhitened")


class PassAtKAdvantage(_Frozen):
    """Pass@k Training (Chen et al. 2025, arXiv:2508.10751): the closed-form advantages of the
    group's k-subsets rewarded by pass@k; binary rewards. ``k`` must not exceed the group size
    (``rollout.n_samples_per_prompt``; checked by the training config and again at use)."""

    estimator: Literal["pass_at_k"] = "pass_at_k"
    k: int = Field(2, ge=1, description="the k of pass@k, 1 <= k <= the group size (k = group size: no signal)")
    eps: float = Field(1e-6, gt=0, description="added to the group std (the authors' code)")


class OPOAdvantage(_Frozen):
    """OPO (Hao et al. 2025, arXiv:2505.23585): r minus the length-weighted group mean reward."""

    estimator: Literal["opo"] = "opo"


class ReMaxAdvantage(_Frozen):
    """ReMax (Li et al. 2023, arXiv:2310.10505): r minus the reward of the greedy response of the
    prompt, which each iteration generates (``baseline_rollout``) and scores (``baseline_rewards``)."""

    estimator: Literal["remax"] = "remax"


class OptimalTokenBaselineAdvantage(_Frozen):
    """verl's optimal token baseline (``compute_optimal_token_baseline_advantage``, docs/algo/otb.md;
    ``tir_optimal_token_baseline``, its multi-turn form, is the same function): returns-to-go minus
    a per-group baseline at each action-token index, weighted by the accumulated
    1 - 2 pi_t + sum_v pi(v)^2 of each sample. Needs the actor stage (it writes
    ``sum_pi_squared``): ``logprobs.recompute_old_logprobs`` true or auto."""

    estimator: Literal["optimal_token_baseline", "tir_optimal_token_baseline"] = "optimal_token_baseline"
    eps: float = Field(1e-8, gt=0, description="added to the baseline's denominator (verl's 1e-8)")
    handle_zero_tail: bool = Field(True, description="baseline 0 on a group's strictly longest response past the "
                                   "second-longest length (verl's default since PR #5380)")


class GPGAdvantage(_Frozen):
    """GPG (Chu et al. 2025, arXiv:2504.02546): alpha (r - group mean) / F_norm, alpha = B / (B - M)
    with M the samples of groups whose rewards are all equal; F_norm = 1, or std + eps."""

    estimator: Literal["gpg"] = "gpg"
    scale_by_std: bool = Field(False, description="F_norm = group std + eps (the paper's best run: F_norm = 1)")
    eps: float = Field(1e-4, gt=0, description="added to the std with scale_by_std (the authors' 1e-4)")


class GDPOAdvantage(_Frozen):
    """GDPO (Liu et al. 2026, arXiv:2601.05242): each reward source's score normalised within its
    group, the normalised scores summed with ``reward_weights``, the sum normalised over the batch.
    Reads the per-source scores of the rewards shard (``reward_metrics``)."""

    estimator: Literal["gdpo"] = "gdpo"
    reward_weights: dict[str, float] | None = Field(
        None, description="reward source -> weight of its group-normalised score; None: every source weight 1 "
        "(refused when the reward recipes weigh sources otherwise: rule gdpo-reward-weights)")
    scale_by_std: bool = Field(True, description="divide each source's centred score by its group std + eps")
    eps: float = Field(1e-6, gt=0, description="added to the group and batch stds")
    batch_norm: Literal["samples", "tokens", "none"] = Field(
        "samples", description="samples: (S - mean) / (std + eps) over the samples (the paper's); tokens: verl's "
        "masked_whiten over the response tokens; none: the weighted sum itself")


ADVANTAGE_CONFIGS = (GRPOAdvantage, DrGRPOAdvantage, RLOOAdvantage, ReinforceAdvantage, ReinforceBaselineAdvantage,
                     CPGDAdvantage, GAEAdvantage, PassAtKAdvantage, OPOAdvantage, ReMaxAdvantage,
                     OptimalTokenBaselineAdvantage, GPGAdvantage, GDPOAdvantage)
AdvantageConfig = _tagged_union(ADVANTAGE_CONFIGS, "estimator", "grpo", "advantage estimator")


def estimator_kwargs(cfg: "AdvantageConfig") -> dict[str, Any]:
    """The keyword arguments of the chosen estimator function (every field but its name)."""
    return cfg.model_dump(exclude={"estimator"})


class ShapingConfig(_Frozen):
    """Reward and advantage shaping, applied in the order of ``rft_core.algorithms.shaping``."""

    overlong_buffer_len: int | None = Field(None, gt=0, description="DAPO soft overlong penalty over the last N tokens of max_new_tokens")
    overlong_penalty_factor: float = Field(1.0, ge=0)
    overlong_filter: bool = Field(False, description="DAPO overlong filtering: truncated responses (finish_reason "
                                  "'length') leave the loss entirely (advantages 0, no policy, KL or entropy term)")
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


class CISPOLoss(_Frozen):
    """CISPO (MiniMax-M1, arXiv:2506.13585 eq. 4-5): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi."""

    name: Literal["cispo"] = "cispo"
    clip_low: float | None = Field(None, ge=0,
                                   description="eps_low of the IS weight; None: no lower bound (the paper's)")
    clip_high: float = Field(0.2, ge=0,
                             description="eps_high of the IS weight (the paper gives no value; verl's example: 0.2)")


class GMPOLoss(_Frozen):
    """GMPO (arXiv:2507.20673), verl's geo_mean: geometric mean of the token ratios per response,
    clipped per token in log space; sequence-level (update.loss_agg=seq-mean-token-mean)."""

    name: Literal["gmpo", "geo_mean"] = "gmpo"
    clip_low: float = Field(0.4, ge=0, description="log-space: token log-ratios clipped at -clip_low (paper: e^-0.4)")
    clip_high: float = Field(0.4, ge=0, description="log-space: token log-ratios clipped at +clip_high (paper: e^0.4)")


class SAPOLoss(_Frozen):
    """SAPO (arXiv:2511.20347): soft sigmoid gate sigmoid(tau (r - 1)) * 4 / tau in place of the clip;
    sequence-level (update.loss_agg=seq-mean-token-mean)."""

    name: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0, description="gate temperature for A > 0")
    tau_neg: float = Field(1.05, gt=0, description="gate temperature for A <= 0 (the paper: larger than tau_pos)")


class GPGLoss(_Frozen):
    """GPG (arXiv:2504.02546): the plain policy gradient -A * log pi (no ratio, no clip)."""

    name: Literal["gpg"] = "gpg"


class ClipCovLoss(_Frozen):
    """Clip-Cov (arXiv:2505.22617): PPO clip, with the gradient of a few random high-covariance tokens detached."""

    name: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(1.0, ge=0, le=1, description="PPO clip, lower (the authors' runs: 1, i.e. none)")
    clip_high: float = Field(1.0, ge=0, description="PPO clip, upper (the authors' runs: 1)")
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="fraction of the micro-batch's tokens detached")
    clip_cov_lb: float = Field(1.0, description="candidates: covariance above this")
    clip_cov_ub: float = Field(5.0, description="candidates: covariance below this")

    @model_validator(mode="after")
    def _check_band(self) -> "ClipCovLoss":
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"update.policy_loss.clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub "
                             f"({self.clip_cov_ub})")
        return self


class KLCovLoss(_Frozen):
    """KL-Cov (arXiv:2505.22617): -r A, plus ppo_kl_coef * |log r| on the top kl_cov_ratio tokens by covariance."""

    name: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(2e-3, gt=0, le=1, description="fraction of the micro-batch's tokens penalised "
                                "(the authors' 7B run; their 32B run and verl: 2e-4)")
    ppo_kl_coef: float = Field(1.0, ge=0,
                               description="coefficient of |log r| (the authors' runs: 1; verl's default 0.1)")


class DPPOTVLoss(_Frozen):
    """DPPO-Binary-TV (Qi et al. 2026, arXiv:2602.04879, eq. 11, 13): -M r A, r = pi / pi_rollout, M drops
    tokens whose |pi - pi_rollout| left [-clip_low, clip_high] in their advantage's direction. Needs the
    rollout's log-probs as old log-probs (no actor pass: rule dppo-anchor-is-the-rollout)."""

    name: Literal["dppo_tv"] = "dppo_tv"
    clip_low: float = Field(0.15, ge=0, le=1, description="TV threshold for A <= 0 (a probability; verl's example: 0.15)")
    clip_high: float = Field(0.15, ge=0, le=1, description="TV threshold for A > 0 (a probability; verl's example: 0.15)")
    ratio_cap: float | None = Field(None, gt=0, description="None: the paper's untruncated ratio; C: the gradient's "
                                    "ratio truncated at C (verl's clip_ratio_c)")


class DPPOKLLoss(_Frozen):
    """DPPO-Binary-KL (Qi et al. 2026, arXiv:2602.04879, eq. 11, 14): as dppo_tv with the binary KL
    KL(Bernoulli(pi_rollout) || Bernoulli(pi)) of the sampled token in place of the TV."""

    name: Literal["dppo_kl"] = "dppo_kl"
    clip_low: float = Field(0.05, ge=0, description="binary-KL threshold (nats) for A <= 0 (verl's example: 0.05)")
    clip_high: float = Field(0.05, ge=0, description="binary-KL threshold (nats) for A > 0 (verl's example: 0.05)")
    ratio_cap: float | None = Field(None, gt=0, description="None: the paper's untruncated ratio; C: the gradient's "
                                    "ratio truncated at C (verl's clip_ratio_c)")


POLICY_LOSS_CONFIGS = (PPOClipLoss, DualClipLoss, GSPOLoss, CPGDLoss, CISPOLoss, GMPOLoss, SAPOLoss, GPGLoss,
                       ClipCovLoss, KLCovLoss, DPPOTVLoss, DPPOKLLoss)


PolicyLossConfig = _tagged_union(POLICY_LOSS_CONFIGS, "name", "ppo_clip", "policy loss")



def policy_loss_kwargs(cfg: "PolicyLossConfig") -> dict[str, Any]:
    """The keyword arguments of the chosen policy loss function (every field but its name)."""
    return cfg.model_dump(exclude={"name"})


class RolloutCorrectionConfig(_Frozen):
    """Truncated importance sampling against the rollout engine's log-probs
    (``rft_core.algorithms.correction``; Yao et al. 2025, https://fengyao.notion.site/off-policy-rl):
    each token's policy loss is weighted by pi_old / pi_rollout (``mode``, ``cap``, ``low``).

    ``enabled`` left out of a training config: on exactly where the ratio is not 1 by
    construction, i.e. old log-probs recomputed by the trainer (``logprobs.recompute_old_logprobs``)
    and an engine or sampling whose distribution is not the trainer's (``rollout.engine`` other
    than hf, ``rollout.top_p`` < 1, or FIRE ``rollout.first_token_temperature``); off otherwise
    (with the engine's own log-probs as old log-probs every ratio is 1). Outside a training
    config the default is off.
    """

    enabled: bool = Field(False, description="left out of a training config: on where the engine's sampling is not the trainer's")
    mode: str = Field("tis", description="tis, icepop, seq-mask-tis, sequence_mask, seq-tis, geo-tis or none (no weight: "
                      "the rejection mask alone)")
    cap: float = Field(2.0, gt=0, description="upper bound (truncation for tis, seq-tis, geo-tis; masking threshold "
                       "for the others)")
    low: float | None = Field(None, ge=0, description="lower bound (None: none)")
    rejection: str | None = Field(None, description="a rejection mask on top of the weights: token_k1, seq_sum_k1, "
                                  "seq_mean_k1, token_k3, seq_sum_k3, seq_mean_k3 or seq_max_k3 (verl's rollout_rs)")
    rejection_cap: float | None = Field(None, gt=0, description="the rejection mask's upper bound: on the ratio "
                                        "pi_old / pi_rollout (k1), on the k3 statistic in nats (k3)")
    rejection_low: float | None = Field(None, gt=0, description="k1 only: lower bound on the ratio (None: "
                                        "1 / rejection_cap, verl's)")

    _m = field_validator("mode")(lambda cls, v: _check_name(ROLLOUT_CORRECTIONS, v))
    _r = field_validator("rejection")(lambda cls, v: v if v is None else _check_name(REJECTION_MASKS, v))

    @model_validator(mode="after")
    def _check_bounds(self) -> "RolloutCorrectionConfig":
        if not math.isfinite(self.cap):
            raise ValueError(f"update.rollout_correction.cap must be finite, got {self.cap}")
        if self.low is not None and self.low >= self.cap:
            raise ValueError(f"update.rollout_correction.low ({self.low}) must be below cap ({self.cap})")
        try:
            check_rejection(self.rejection, self.rejection_cap, self.rejection_low)
        except ValueError as exc:
            raise ValueError(str(exc).replace("rollout_correction: ", "update.rollout_correction.")) from None
        if self.mode == "none" and self.rejection is None:
            raise ValueError("update.rollout_correction.mode=none applies no importance weight: it needs "
                             "update.rollout_correction.rejection (a rejection mask), or another mode")
        return self

    def correction_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``rft_core.algorithms.rollout_correction`` (every field but ``enabled``)."""
        return self.model_dump(exclude={"enabled"})
