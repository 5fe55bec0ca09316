"""Typed, frozen configs for every stage, composed into a training config.

YAML presets live in ``configs/``; any value can be overridden with dotted keys
(``rollout.temperature=0.7``) from the CLI or prefect.yaml. Unknown keys are errors.

The sections live in submodules by responsibility (``data``, ``generation``, ``rewards``,
``algorithms``, ``scale``, ``run``; the update, the critic and the whole training config here);
everything is re-exported here, so ``from rft_core.config import X`` works for every model.
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_serializer, model_validator

from rft_core.algorithms import ADVANTAGE_ESTIMATORS
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS, POLICY_LOSSES, check_policy_loss_aggregation
from rft_core.algorithms.value_loss import VALUE_LOSSES
from rft_core.config._base import (  # noqa: F401
    TAG_KEYS, _check_name, _check_token_budget, _Frozen, _given, _tagged_union, strip_tags)
from rft_core.config.algorithms import (  # noqa: F401
    ADVANTAGE_CONFIGS, DEFAULT_KL_ESTIMATOR, PAPER_KL_MODE, POLICY_LOSS_CONFIGS, AdvantageConfig, CPGDAdvantage, CPGDLoss,
    DrGRPOAdvantage, DualClipLoss, DynamicSamplingConfig, GAEAdvantage, GRPOAdvantage, GSPOLoss, KLConfig,
    PolicyLossConfig, PPOClipLoss, ReinforceAdvantage, ReinforceBaselineAdvantage, RLOOAdvantage,
    OPOAdvantage, OptimalTokenBaselineAdvantage, PassAtKAdvantage, ReMaxAdvantage,
    RolloutCorrectionConfig, ShapingConfig, TrainState, estimator_kwargs, policy_loss_kwargs)
from rft_core.config.rewards import (  # noqa: F401
    DEFAULT_JUDGE_TEMPLATE, REWARD_SOURCE_CONFIGS, CodeExecSource, ExactMatchSource, FormatSource, LLMJudgeSource,
    MathAnswerSource, PythonSource, RecipeItem, RemoteSource, RewardConfig, RewardModelSource, RewardSourceConfig)
from rft_core.config.agents import AgentConfig  # noqa: F401
from rft_core.config.data import DataConfig, DataSourceConfig, EvalConfig  # noqa: F401
from rft_core.config.deprecated import DeprecatedKeyWarning, move_renamed_keys  # noqa: F401
from rft_core.config.generation import (  # noqa: F401
    LogprobConfig,
    ModelConfig,
    PartialRolloutConfig,
    RolloutConfig,
    TeacherConfig,
    UpdateGrouping,
)
from rft_core.config._errors import error_line
from rft_core.models.logprobs import default_device
from rft_core.config.rules import CONTRADICTIONS, contradictions  # noqa: F401
from rft_core.config.run import CheckpointConfig, ObserveConfig, WandbConfig  # noqa: F401
from rft_core.config.scale import (  # noqa: F401
    RAY_ROLES, RESIDENT_STAGES, ROLLOUT_SHARD, RUNNABLE_STAGES, DeepSpeedConfig, FSDPConfig, LoraConfig, OrchestrationConfig,
    RayConfig, RunnerConfig, SGLangConfig, VLLMConfig, WorkersConfig)


def _field(section: Any, key: str, default: Any) -> Any:
    """``key`` of a raw config section (mapping or model), or ``default`` when it is not given."""
    if isinstance(section, BaseModel):
        return getattr(section, key, default)
    if isinstance(section, Mapping):
        value = section.get(key)
        return default if value is None else value
    return default


def _tag(section: Any, key: str, default: str) -> str:
    """The name that picks the class of a raw tagged section (``_tagged_union``): a bare name
    (``update.policy_loss=gspo``) as is, else its ``key`` field, else ``default``."""
    return section if isinstance(section, str) else _field(section, key, default)


def _engine_sampling_differs(rollout: Any) -> bool:
    """Whether the rollout samples from another distribution than the trainer's pi_old at
    ``rollout.temperature``: an engine other than hf (other kernels and precision), top-p
    truncation, FIRE's first-token temperature, or an older policy (``rollout.max_staleness``). Unparseable values count as not differing
    (validation reports them)."""
    try:
        engine = _field(rollout, "engine", RolloutConfig.model_fields["engine"].default)
        top_p = float(_field(rollout, "top_p", RolloutConfig.model_fields["top_p"].default))
        fire = _field(rollout, "first_token_temperature", None)
        stale = int(_field(rollout, "max_staleness", 0) or 0)
    except (TypeError, ValueError):
        return False
    return engine != "hf" or top_p < 1.0 or fire is not None or stale > 0


class UpdateConfig(_Frozen):
    """PPO-style update of the policy: AdamW, micro-batches, gradient accumulation, clipping, and
    the loss terms (docs/algorithms.md)."""

    policy_loss: PolicyLossConfig = PPOClipLoss()
    loss_agg: str = Field("token-mean", description="left out with policy_loss gspo: seq-mean-token-mean (GSPO's own)")
    loss_norm_tokens: int | None = Field(None, gt=0, description="constant of seq-mean-token-sum-norm (left out of a "
                                         "training config: rollout.max_new_tokens)")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    epochs: int = Field(1, gt=0)
    train_batch_size: int | None = Field(None, gt=0, description="sequences per optimizer step (None: the whole rollout)")
    micro_batch_size: int = Field(4, gt=0, description="sequences per forward/backward")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="cut each mini-batch into packed micro-batches of at most this many tokens (prompt + "
        "response), balanced by tokens, instead of micro_batch_size sequences (verl's ppo_max_token_len_per_gpu with "
        "use_dynamic_bsz; needs packing; rft_core.training.loop.token_budget_micro_batches). None: micro_batch_size")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight")
    entropy_top_fraction: float | None = Field(None, gt=0, le=1, description="train only on this top fraction of tokens by entropy (arXiv:2506.01939); needs the actor stage")
    entropy_filter_norm: Literal["all", "kept"] = Field(
        "all", description="entropy filter normaliser: all response tokens (TRL; KL on every token) or the kept ones only")
    dropout: bool = Field(False, description="keep the model's dropout on in the update (off: as TRL's PPO "
                          "trainer; LoRA's own lora.dropout is kept either way)")
    cpgd_drift_coef: float = Field(0.0, ge=0, description="CPGD policy-drift term: coef * KL(pi_old || pi) (policy_loss cpgd only)")
    rollout_correction: RolloutCorrectionConfig = Field(
        RolloutCorrectionConfig(), description="truncated IS against the engine's log-probs (left out: on where they differ)")
    gradient_checkpointing: bool = False
    seed: int = 0
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (peft) instead of every weight")
    packing: bool = Field(True, description="pack each micro-batch into one row without padding (position ids restart "
                          "per sequence; False: padded rows)")
    deepspeed: DeepSpeedConfig | None = Field(None, description="DeepSpeed ZeRO (multi-rank, under torchrun)")
    fsdp: FSDPConfig | None = Field(None, description="torch FSDP2 (multi-rank, under torchrun or policy_ranks; not "
                                    "with deepspeed)")

    _a = field_validator("loss_agg")(lambda cls, v: _check_name(LOSS_AGGREGATIONS, v))

    @model_validator(mode="before")
    @classmethod
    def _aggregation_of_the_loss(cls, data: Any) -> Any:
        """A policy loss whose paper fixes the aggregation (GSPO) gets it when loss_agg is left out."""
        if isinstance(data, dict) and data.get("loss_agg") is None:
            name = _tag(data.get("policy_loss"), "name", PPOClipLoss.model_fields["name"].default)
            required = POLICY_LOSSES.info(name).required_loss_agg if name in POLICY_LOSSES else None
            if required is not None:
                data = {**data, "loss_agg": required}
        return data

    @model_validator(mode="after")
    def _check(self) -> "UpdateConfig":
        check_policy_loss_aggregation(self.policy_loss.name, self.loss_agg)
        _check_token_budget("update", self.max_tokens_per_micro_batch, self.packing)
        if self.cpgd_drift_coef > 0 and self.policy_loss.name != "cpgd":
            raise ValueError("update.cpgd_drift_coef is CPGD's policy-drift term (arXiv:2505.12504): it needs "
                             f"update.policy_loss.name=cpgd, got {self.policy_loss.name!r}")
        return self


class CriticConfig(_Frozen):
    """The critic (value model), used when the advantage estimator needs values (gae)."""

    model: ModelConfig | None = Field(None, description="None: start from the initial policy with a zero value head")
    value_loss: str = "clipped_mse"
    value_clip: float | None = Field(0.2, gt=0)
    loss_agg: str = "token-mean"
    lr: float = Field(5e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    epochs: int = Field(1, gt=0)
    train_batch_size: int | None = Field(None, gt=0)
    micro_batch_size: int = Field(4, gt=0)
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="micro-batches of at most this many tokens (prompt + response) in the values pass and "
        "the update, as update.max_tokens_per_micro_batch (needs packing). None: micro_batch_size")
    seed: int = 0
    packing: bool = Field(False, description="pack each micro-batch into one row without padding (values and update)")
    deepspeed: DeepSpeedConfig | None = Field(None, description="DeepSpeed ZeRO for the critic (multi-rank: under "
                                              "torchrun, or orchestration.critic_ranks resident)")
    fsdp: FSDPConfig | None = Field(None, description="torch FSDP2 for the critic (multi-rank: under torchrun, or "
                                    "orchestration.critic_ranks resident; not with deepspeed)")

    _v = field_validator("value_loss")(lambda cls, v: _check_name(VALUE_LOSSES, v))
    _a = field_validator("loss_agg")(lambda cls, v: _check_name(LOSS_AGGREGATIONS, v))

    @model_validator(mode="after")
    def _check_budget(self) -> "CriticConfig":
        _check_token_budget("critic", self.max_tokens_per_micro_batch, self.packing)
        return self

    @property
    def sharded(self) -> bool:
        """Whether the critic trains sharded over ranks (``deepspeed`` or ``fsdp``)."""
        return self.deepspeed is not None or self.fsdp is not None

    @property
    def dtype(self) -> str:
        """dtype of the critic weights."""
        return self.model.dtype if self.model else "float32"


def auto_workers(cfg: "TrainConfig") -> tuple[str, str]:
    """What ``orchestration.workers: auto`` runs ``cfg`` with, and why: ``resident`` when Ray is
    installed, resident workers cover ``cfg`` (``TrainConfig.resident_blockers``) and either this
    process sees a CUDA device (``default_device()``: ``$RFT_DEVICE`` wins) or ``ray.address``
    names a cluster (a driver without a GPU in front of GPU nodes); else ``stage``. On a GPU the
    resident workers are the fast mode (issue 44: 2.8x stage mode per step on an H200 at a 0.4B
    shape); on a CPU the stages' compute hides the loads, and stage mode needs no Ray."""
    cluster = cfg.ray.address is not None
    if default_device().type != "cuda" and not cluster:
        return "stage", f"no CUDA device is visible (device {default_device()}) and ray.address names no cluster"
    where = f"ray.address names a cluster ({cfg.ray.address})" if cluster else "a CUDA device is visible"
    if importlib.util.find_spec("ray") is None:
        return "stage", f"{where} but Ray is not installed (pip install 'prefect-rft[gpu]')"
    blockers = cfg.resident_blockers()
    if blockers:
        return "stage", "resident workers do not cover this config: " + "; ".join(blockers)
    beside = ""
    if cfg.needs_critic and "critic_update" not in cfg.resident_stages:
        beside = ("; the DeepSpeed or FSDP2 critic's stages run beside the workers as runners.critic_values / "
                  "runners.critic_update say: give them GPUs Ray does not take (docs/scale.md, 'Resident workers')")
    return "resident", f"{where} and Ray is installed{beside}"


class TrainConfig(_Frozen):
    """A whole training run: N iterations under one run root."""

    name: str = "grpo"
    run_root: str = "runs/grpo"
    iterations: int = Field(2, gt=0)
    policy: ModelConfig = ModelConfig()
    reference: ModelConfig | None = Field(None, description="None: the initial policy")
    teacher: TeacherConfig = Field(TeacherConfig(), description="on-policy distillation: the teacher and the weight of "
                                   "its per-token signal (off while teacher.path is None)")
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    kl: KLConfig = KLConfig()
    advantage: AdvantageConfig = GRPOAdvantage()
    shaping: ShapingConfig = ShapingConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    logprobs: LogprobConfig = LogprobConfig()
    update: UpdateConfig = UpdateConfig()
    critic: CriticConfig = CriticConfig()
    eval: EvalConfig = EvalConfig()
    observe: ObserveConfig = ObserveConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    ray: RayConfig = Field(RayConfig(), description="the Ray cluster and each role's Ray options, for the rollout "
                           "fan-out (runners.rollout.shards > 1) and the resident workers (orchestration.workers=resident)")
    runners: dict[str, RunnerConfig] = Field(default_factory=dict, description=f"per stage ({', '.join(RUNNABLE_STAGES)}): where its program runs")
    _workers_choice: str | None = PrivateAttr(None)

    @field_validator("runners")
    @classmethod
    def _check_runner_stages(cls, v: dict) -> dict:
        bad = sorted(set(v) - set(RUNNABLE_STAGES))
        if bad:
            raise ValueError(f"unknown stage(s) {bad}; valid names: {', '.join(RUNNABLE_STAGES)}")
        sharded = sorted(k for k, r in v.items() if r.shards > 1 and k != "rollout")
        if sharded:
            raise ValueError(f"shards > 1 is supported for the rollout stage only, not {sharded}")
        return v

    def runner(self, stage: str) -> RunnerConfig:
        """The runner of ``stage``: ``runners[stage]`` when configured; with
        ``orchestration.workers: resident`` a stage of ``resident_stages`` runs in its resident
        worker (the pool named after the run root, on the Ray cluster of ``ray``); otherwise in
        the task's process, keeping its models in memory between stages when ``keeps_models``
        (``RunnerConfig.keep_models``) in stage mode (beside resident workers it keeps none)."""
        o = self.orchestration
        # beside resident workers the task's process keeps no model (a sharded critic's stages): it would hold
        # their GPU memory for nothing, since no stage after them in this process reuses it
        keep = self.keeps_models and o.workers != "resident"
        if stage in self.runners:
            r = self.runners[stage]
            return r.model_copy(update={"keep_models": keep}) if r.mode == "inprocess" else r
        if o.workers == "resident" and stage in self.resident_stages:
            return RunnerConfig(mode="resident", workers=WorkersConfig(
                pool=self.run_root, ray=self.ray, sync_timeout_s=o.sync_timeout_s, sync_bucket_mb=o.sync_bucket_mb,
                threads=o.worker_threads, policy_ranks=o.policy_ranks, critic_ranks=o.critic_ranks,
                rollout_versions=max(1, self.rollout.max_staleness),
                rollout_gpus=getattr(getattr(self.rollout, self.rollout.engine, None), "tensor_parallel_size", 1),
                keep_device_cache=self.rollout.engine == "hf", lora=self.update.lora))
        return RunnerConfig(keep_models=keep)

    @property
    def resident_stages(self) -> tuple[str, ...]:
        """The stages of ``RESIDENT_STAGES`` that ``orchestration.workers: resident`` runs in a
        resident worker: all of them, except a DeepSpeed or FSDP2 critic's (``critic_values``,
        ``critic_update``) when ``runners.critic_values`` or ``runners.critic_update`` is given:
        those two then run as the runners say (torchrun for its ranks, a GPU of their own), beside
        the workers, meeting them through committed shards and the critic's checkpoint only, so
        the run commits stage mode's files either way. Without such a runner a sharded critic
        runs in the resident critic gang (``orchestration.critic_ranks`` ranks), which keeps its
        shards and AdamW state across iterations."""
        if not (self.critic.sharded and ({"critic_values", "critic_update"} & set(self.runners))):
            return RESIDENT_STAGES
        return tuple(s for s in RESIDENT_STAGES if s not in ("critic_values", "critic_update"))

    @property
    def first_resident_stages(self) -> tuple[str, ...]:
        """The stages of ``RESIDENT_STAGES`` the first iteration runs in resident workers (the
        rollout unsharded; the actor pass when old log-probs are recomputed; the reference pass
        with a KL coefficient > 0; the critic's with an estimator that needs values; the teacher's
        with ``teacher.path``; the update): whose workers the run starts together before its
        first stage (``rft_core.workers.pool.start_run_workers``). Empty in stage mode."""
        runs = {"rollout": self.runner("rollout").shards == 1, "actor_logprobs": self.recomputes_old_logprobs,
                "ref_logprobs": self.kl.needs_reference, "ppo_update": True, "critic_values": self.needs_critic,
                "critic_update": self.needs_critic, "teacher_logprobs": self.teacher.path is not None}
        return tuple(s for s in RESIDENT_STAGES if runs[s] and self.runner(s).mode == "resident")

    @property
    def keeps_models(self) -> bool:
        """Whether in-process stages keep their models in memory between stages
        (``orchestration.keep_models``; auto: with the HF rollout engine)."""
        keep = self.orchestration.keep_models
        return self.rollout.engine == "hf" if keep is None else keep

    @property
    def background_checkpoint(self) -> bool:
        """Whether a checkpoint iteration's weights are written in the background
        (``PPOUpdateInput.background_checkpoint``), with ``checkpoint.async_weights``: under
        resident workers, and in stage mode when the stages keep their models in memory
        (``keeps_models``: the trainer the write reads stays there)."""
        return self.checkpoint.async_weights and (self.orchestration.workers == "resident" or self.keeps_models)

    def syncs_rollout_ahead(self, iteration: int) -> bool:
        """Whether the update of ``iteration`` is handed to the resident rollout worker right away
        (``rft_core.workers.pool.sync_rollout_ahead``: the next rollout finds it synced): a
        synchronous run (``rollout.max_staleness`` 0: the next rollout samples with exactly this
        update) whose rollout runs unsharded in a resident worker on the HF engine, and not the
        last iteration (no rollout follows it)."""
        runner = self.runner("rollout")
        return (runner.mode == "resident" and runner.shards == 1 and self.rollout.max_staleness == 0
                and self.rollout.engine == "hf" and iteration < self.iterations)

    @property
    def resident_pool(self) -> str | None:
        """The name of the run's resident workers' pool (the run root), or None with ``workers: stage``."""
        return self.run_root if self.orchestration.workers == "resident" else None

    def is_checkpoint(self, iteration: int) -> bool:
        """Whether the update of ``iteration`` writes the policy's weights and optimizer state
        (``checkpoint.every``, and the run's last iteration)."""
        return self.checkpoint.is_checkpoint(iteration, self.iterations)

    def kept_policy_blockers(self) -> list[str]:
        """Why stage mode cannot keep the policy in memory between checkpoints in this config
        (``checkpoint.every`` > 1 without resident workers; empty: it can). It can where the
        rollout, the actor pass and the update run in one process that keeps its models
        (``keeps_models``) with a single-process full-weight trainer: the update keeps its trainer
        (``rft_core.stages.memo``), the next rollout's model is made from it, and a rerun rebuilds
        it exactly from the last checkpoint (``rft_core.stages.recovery.keep_rebuilt``)."""
        reasons = []
        if not self.keeps_models:
            why = ("orchestration.keep_models=false" if self.orchestration.keep_models is False else
                   f"rollout.engine={self.rollout.engine} (orchestration.keep_models auto keeps models with the hf "
                   "engine only)")
            reasons.append(f"{why}: every stage loads the policy from the run root")
        for stage in ("rollout", "actor_logprobs", "ppo_update"):
            mode = self.runner(stage).mode
            if mode != "inprocess":
                reasons.append(f"runners.{stage}.mode={mode} runs that stage in a process of its own, which holds no "
                               "kept policy")
        if self.runner("rollout").shards != 1:
            reasons.append(f"runners.rollout.shards={self.runner('rollout').shards}: the rollout's shards run as tasks "
                           "of their own on the Ray cluster, which hold no kept policy")
        if self.update.lora is not None:
            reasons.append("update.lora: the next rollout's model is made from the kept trainer's full weights, not "
                           "from LoRA adapters, so far")
        for key in ("deepspeed", "fsdp"):
            if getattr(self.update, key) is not None:
                reasons.append(f"update.{key}: stage mode keeps a single-process trainer (a sharded trainer is kept by "
                               "the resident workers)")
        if self.rollout.max_staleness > 0:
            reasons.append(f"rollout.max_staleness={self.rollout.max_staleness}: the next rollout runs during the update, "
                           "while the kept trainer is taken out")
        return reasons

    def resident_blockers(self) -> list[str]:
        """What ``orchestration.workers: resident`` does not cover yet in this config (empty: it
        covers it). Each is refused when the config loads."""
        reasons = []
        if self.update.deepspeed is not None and self.update.lora is not None:
            reasons.append("update.deepspeed with update.lora: the resident DeepSpeed trainer gathers full weights for a "
                           "sync, not a LoRA policy's merged weights or adapters, so far (LoRA alone, or DeepSpeed "
                           "alone, is covered)")
        if self.orchestration.policy_ranks > 1 and self.update.deepspeed is None and self.update.fsdp is None:
            reasons.append(f"orchestration.policy_ranks={self.orchestration.policy_ranks}: several policy ranks are "
                           "DeepSpeed or FSDP2 data parallelism; set update.deepspeed.zero_stage (1, 2 or 3) or "
                           "update.fsdp")
        critic_ranks = self.orchestration.critic_ranks
        critic_runners = sorted({"critic_values", "critic_update"} & set(self.runners))
        if critic_ranks > 1 and self.needs_critic and not self.critic.sharded:
            reasons.append(f"orchestration.critic_ranks={critic_ranks}: several critic ranks are DeepSpeed or FSDP2 "
                           "data parallelism; set critic.deepspeed.zero_stage (1, 2 or 3) or critic.fsdp")
        elif critic_ranks > 1 and self.needs_critic and critic_runners:
            reasons.append(f"orchestration.critic_ranks={critic_ranks} with runners.{critic_runners[0]}: the critic's "
                           "stages then run as its runners say, beside the resident workers (torchrun's "
                           "nproc_per_node sets their ranks); drop one of the two")
        if self.rollout.max_staleness > 1 and self.rollout.engine != "hf":
            reasons.append(f"rollout.max_staleness={self.rollout.max_staleness} with rollout.engine={self.rollout.engine}: "
                           "a resident GPU engine holds one policy version (the hf engine's rollout worker keeps one "
                           "copy per version)")
        clash = sorted(s for s in self.resident_stages if s in self.runners)
        if clash:
            reasons.append(f"runners.{clash[0]} sets how {clash[0]} starts a process of its own, but "
                           "orchestration.workers=resident runs it in its resident worker: remove "
                           f"runners.{clash[0]}, or set orchestration.workers=stage")
        return reasons

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """The old keys of ``rft_core.config.deprecated`` moved to their new keys, each with a
        ``DeprecatedKeyWarning`` that names the new key (read this release, removed in the next)."""
        return move_renamed_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_other_sections(cls, data: Any) -> Any:
        """Fill in the defaults that depend on other sections, where the config leaves them out:
        ``kl.mode`` (the advantage estimator's paper, ``PAPER_KL_MODE``),
        ``update.rollout_correction.enabled`` (on where the engine's sampling distribution is
        not the trainer's and the trainer recomputes the old log-probs) and
        ``update.loss_norm_tokens`` (``rollout.max_new_tokens`` for seq-mean-token-sum-norm)."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        kl = _given(data.get("kl"))
        estimator = _tag(data.get("advantage"), "estimator", "grpo")
        if isinstance(kl, dict) and "mode" not in kl and estimator in PAPER_KL_MODE:
            data["kl"] = {**kl, "mode": PAPER_KL_MODE[estimator]}
        upd = _given(data.get("update"))
        if not isinstance(upd, dict):
            return data
        rollout, logprobs = data.get("rollout"), data.get("logprobs")
        rc = _given(upd.get("rollout_correction"))
        if isinstance(rc, dict) and "enabled" not in rc:
            upd["rollout_correction"] = {**rc, "enabled": _engine_sampling_differs(rollout) and bool(
                _field(logprobs, "recompute_old_logprobs", LogprobConfig.model_fields["recompute_old_logprobs"].default))}
        if upd.get("loss_agg") == "seq-mean-token-sum-norm" and upd.get("loss_norm_tokens") is None:
            upd["loss_norm_tokens"] = _field(rollout, "max_new_tokens", RolloutConfig.model_fields["max_new_tokens"].default)
        data["update"] = upd
        return data

    @model_validator(mode="after")
    def _choose_workers(self) -> "TrainConfig":
        """``orchestration.workers: auto`` becomes ``resident`` or ``stage`` here, before the
        checks that depend on it (``_check``); ``workers_choice`` keeps the sentence the run logs."""
        if self.orchestration.workers != "auto":
            return self
        mode, why = auto_workers(self)
        object.__setattr__(self, "orchestration", self.orchestration.model_copy(update={"workers": mode}))
        self._workers_choice = f"orchestration.workers=auto chose {mode}: {why}"
        return self

    @property
    def workers_choice(self) -> str:
        """Where the model stages run and why, as the run logs it: what ``orchestration.workers:
        auto`` chose, or the mode the config named."""
        return self._workers_choice or f"orchestration.workers={self.orchestration.workers} (set in the config)"

    @model_serializer(mode="wrap")
    def _dump_auto(self, handler: Any) -> Any:
        """A config whose mode ``auto`` chose dumps ``orchestration.workers: auto``, so that it
        is chosen again where it loads (a deployment's worker machine, a subprocess)."""
        data = handler(self)
        if self._workers_choice is not None and isinstance(data, dict) and isinstance(data.get("orchestration"), dict):
            data["orchestration"] = {**data["orchestration"], "workers": "auto"}
        return data

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.update.entropy_top_fraction is not None and self.logprobs.recompute_old_logprobs is False:
            raise ValueError("update.entropy_top_fraction needs the actor stage's entropies: set logprobs.recompute_old_logprobs=true")
        if self.update.rollout_correction.enabled and self.logprobs.recompute_old_logprobs is False:
            raise ValueError("update.rollout_correction weights pi_old / pi_rollout with the trainer's old log-probs: set "
                             "logprobs.recompute_old_logprobs=true (with the engine's log-probs as old log-probs every "
                             "weight is 1; the PPO ratio is then taken against the engine's distribution)")
        if self.update.train_batch_size is not None and self.update.train_batch_size < self.update.micro_batch_size:
            raise ValueError("update.train_batch_size must be >= update.micro_batch_size")
        if self.checkpoint.every > 1 and self.orchestration.workers != "resident" and self.kept_policy_blockers():
            raise ValueError(f"checkpoint.every={self.checkpoint.every} keeps the policy in memory between checkpoints: "
                             "under orchestration.workers=resident, or in stage mode in the process that runs the "
                             "stages, which this config cannot: " + "; ".join(self.kept_policy_blockers())
                             + ". Set orchestration.workers=resident, or checkpoint.every=1")
        if self.rollout.max_staleness > 0:
            if self.logprobs.recompute_old_logprobs is False:
                raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} trains on tokens sampled by an "
                                 "older policy: the update needs the actor pass's log-probs of its own starting policy "
                                 "(the proximal policy); set logprobs.recompute_old_logprobs=true (or auto)")
            if not self.update.rollout_correction.enabled:
                raise ValueError(f"rollout.max_staleness={self.rollout.max_staleness} needs "
                                 "update.rollout_correction.enabled=true: decoupled PPO weighs the policy term by "
                                 "pi_proximal / pi_behaviour (AReaL, arXiv:2505.24298); without it the stale samples "
                                 "would be trained on as if on-policy")
        broken = contradictions(self)
        if broken:
            raise ValueError("\n".join(broken))
        if self.orchestration.workers == "resident" and self.resident_blockers():
            raise ValueError("orchestration.workers=resident: " + "; ".join(self.resident_blockers()))
        return self

    def with_resolved_run_root(self, now: "_dt.datetime | None" = None) -> "TrainConfig":
        """A copy whose run_root has ``{timestamp}`` (YYYYmmdd-HHMMSS) and ``{name}`` filled in
        and, for a local path, is made absolute."""
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        root = self.run_root.format(timestamp=stamp, name=self.name)
        if "://" not in root:
            root = str(Path(root).expanduser().resolve())
        return self.model_copy(update={"run_root": root})

    def old_logprobs_blockers(self) -> list[str]:
        """Why the rollout engine's log-probs cannot stand for the trainer's old log-probs; empty
        when they can, and ``logprobs.recompute_old_logprobs: auto`` then skips the actor stage.

        They can when the update is on-policy and the engine scores tokens as the trainer's
        forward pass does: the hf engine (the policy's own weights and kernels) sampling from the
        full distribution at ``rollout.temperature`` (top-p 1, no FIRE), in float32 (a bfloat16
        KV-cache decode and a bfloat16 full-sequence pass round differently, by about 1e-2), one
        turn per sample (no agent), one optimizer step per rollout (``update.epochs`` 1 and the
        whole rollout in one step), and nothing that needs the actor stage's own outputs (the
        entropy filter, rollout correction, the optimal token baseline's sum_pi_squared). Then pi_old is the engine's distribution and the two
        log-probs agree to float32 rounding (about 1e-6, ``tests/rft_core/engines``); every
        update checks it again (``approx_kl`` of its first step, before any weight changes, is
        0.5 * mean((logp - old_logp)^2)). This is TRL's ``num_iterations=1`` behaviour (its
        GRPOTrainer takes the old log-probs as the current ones, detached) and verl's "bypass"
        mode.
        """
        r, u = self.rollout, self.update
        reasons = []
        if r.engine != "hf":
            reasons.append(f"rollout.engine={r.engine} (other kernels and precision than the trainer)")
        if r.top_p < 1.0 or r.first_token_temperature is not None:
            reasons.append("the engine samples from a processed distribution (rollout.top_p < 1 or FIRE)")
        if r.agent is not None:
            reasons.append("multi-turn rollout (rollout.agent)")
        if self.policy.dtype != "float32":
            reasons.append(f"policy.dtype={self.policy.dtype} (decode and full passes round differently below float32)")
        rollout_size = self.data.prompts_per_iteration * r.n_samples_per_prompt
        if u.epochs > 1 or (u.train_batch_size is not None and u.train_batch_size < rollout_size):
            reasons.append("more than one optimizer step per rollout (update.epochs, update.train_batch_size)")
        if u.entropy_top_fraction is not None:
            reasons.append("update.entropy_top_fraction needs the actor stage's entropies")
        if u.rollout_correction.enabled:
            reasons.append("update.rollout_correction weighs the trainer's old log-probs against the engine's")
        if r.max_staleness > 0:
            reasons.append("rollout.max_staleness >= 1: the update needs its starting (proximal) policy's log-probs")
        if self.needs_sum_pi_squared:
            reasons.append(f"advantage.estimator={self.advantage.estimator} needs sum_v pi_old(v)^2 at every token "
                           "from the actor stage (sum_pi_squared)")
        return reasons

    def rollout_policy_version(self, iteration: int) -> int:
        """The policy version the rollout of ``iteration`` samples with: the policy produced by
        the update of iteration ``max(0, iteration - 1 - rollout.max_staleness)`` (version 0:
        the initial policy). A pure function of the iteration and the staleness, never "the
        latest weights", so an asynchronous run is reproducible and resumable."""
        return max(0, iteration - 1 - self.rollout.max_staleness)

    @property
    def logprob_grouping(self) -> UpdateGrouping | None:
        """``logprob_grouping_at(1)``: the grouping of iteration 1's passes (what ``python -m
        rft_core.stages <pass> --config`` fills in; the flow gives each iteration its own)."""
        return self.logprob_grouping_at(1)

    def logprob_grouping_at(self, iteration: int) -> UpdateGrouping | None:
        """Below float32 (``policy.dtype`` bfloat16 or auto): the first-epoch grouping of the update
        of ``iteration`` (which starts from policy version ``iteration - 1``, whose shuffle seed it
        mixes in: ``update_seeds``), which that iteration's actor and reference passes then use
        instead of their own length-sorted micro-batches of ``logprobs.micro_batch_size``.
        bfloat16 kernels (attention blocks sized by the packed row's length, sums over its keys)
        round differently for the same sequence in another row; with the same rows the update's
        first step sees the passes' log-probs exactly (approx_kl 0 and KL loss 0 between a policy
        and itself; 7.4e-4 on SmolLM2-135M with the demo's 8-per-row passes and 4-per-row update).
        None in float32, where the groupings agree to rounding (1e-6) and the passes keep their
        faster length-sorted rows.

        Raises:
            ValueError: ``iteration`` < 1.
        """
        if iteration < 1:
            raise ValueError(f"logprob_grouping_at: iteration {iteration} is not >= 1")
        if self.policy.dtype == "float32":
            return None
        u = self.update
        return UpdateGrouping(train_batch_size=u.train_batch_size, micro_batch_size=u.micro_batch_size, seed=u.seed,
                              packing=u.packing, policy_version=iteration - 1,
                              max_tokens_per_micro_batch=u.max_tokens_per_micro_batch)

    @property
    def recomputes_old_logprobs(self) -> bool:
        """Whether an actor stage recomputes the old log-probs: ``logprobs.recompute_old_logprobs``
        resolved (``auto``: when ``old_logprobs_blockers`` names a reason)."""
        value = self.logprobs.recompute_old_logprobs
        return bool(self.old_logprobs_blockers()) if value == "auto" else bool(value)

    @property
    def needs_critic(self) -> bool:
        """True when the advantage estimator needs critic values (the critic stages run)."""
        return ADVANTAGE_ESTIMATORS.info(self.advantage.estimator).needs_critic

    @property
    def needs_greedy_baseline(self) -> bool:
        """True when the advantage estimator subtracts the reward of a greedy response of each
        prompt (remax): the iteration runs the ``baseline_rollout`` and ``baseline_rewards`` stages."""
        return ADVANTAGE_ESTIMATORS.info(self.advantage.estimator).greedy_baseline

    @property
    def needs_sum_pi_squared(self) -> bool:
        """True when the advantage estimator takes sum_v pi_old(v)^2 at every response token
        (optimal_token_baseline, ``EstimatorInfo.needs_sum_pi_squared``): the actor stage runs
        (``old_logprobs_blockers``) with ``ActorLogprobsInput.with_sum_pi_squared``."""
        return ADVANTAGE_ESTIMATORS.info(self.advantage.estimator).needs_sum_pi_squared

    @property
    def advantage_rollout_correction(self) -> RolloutCorrectionConfig | None:
        """The rollout correction the advantages stage needs (``AdvantagesInput.rollout_correction``):
        ``update.rollout_correction`` when it is on and the estimator weighs its baseline by the
        importance weights (``needs_sum_pi_squared``: the optimal token baseline's w_t * rho_t^2,
        as verl's trainer passes ``rollout_is_weights``); None otherwise, which enters no hash."""
        rc = self.update.rollout_correction
        return rc if self.needs_sum_pi_squared and rc.enabled else None

    @property
    def teacher_temperature(self) -> float:
        """The temperature of the teacher's log-probs (on-policy distillation): ``teacher.temperature``,
        or when unset ``rollout.temperature``, the temperature of the student's pi_old."""
        return self.teacher.temperature if self.teacher.temperature is not None else self.rollout.temperature

    @property
    def initial_critic(self) -> str:
        """Model path the critic starts from."""
        return (self.critic.model or self.policy).path

    @property
    def initial_state(self) -> TrainState:
        """The state of iteration 1."""
        return TrainState(kl_coef=self.kl.kl_coef)

    @property
    def reference_model(self) -> ModelConfig:
        """The reference model config (the initial policy unless set)."""
        return self.reference or self.policy


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text) if text.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Apply dotted overrides (``["rollout.temperature=0.7"]`` or a mapping) to a raw dict.

    Values are parsed as YAML scalars (``0.7`` -> float, ``true`` -> bool, ``[1,2]`` -> list).

    Raises:
        ConfigError: an override without '=' or one that descends into a non-mapping.
    """
    items = overrides.items() if isinstance(overrides, Mapping) else []
    if not isinstance(overrides, Mapping):
        parsed = []
        for ov in overrides:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r} must look like key.sub=value")
            key, value = ov.split("=", 1)
            parsed.append((key.strip(), _parse_value(value)))
        items = parsed
    out = dict(raw)
    for key, value in items:
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | Mapping[str, Any] = ()) -> TrainConfig:
    """Load a YAML preset (or the defaults when ``path`` is None) and apply overrides.

    Raises:
        ConfigError: missing/unreadable file, bad YAML, unknown key, bad value, unknown
            registry name; the message names the key and lists valid names where it can.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    raw = apply_overrides(raw, overrides)
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("invalid config:\n  " + "\n  ".join(error_line(e, TrainConfig) for e in exc.errors())) from None
