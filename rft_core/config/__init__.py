"""Typed, frozen configs for every stage, composed into a training config.

YAML presets live in ``configs/``; any value can be overridden with dotted keys
(``rollout.temperature=0.7``) from the CLI or prefect.yaml. Unknown keys are errors.

The sections live in submodules by responsibility (``data``, ``generation``, ``rewards``,
``algorithms``, ``scale``, ``run``; the update, the critic and the whole training config here);
everything is re-exported here, so ``from rft_core.config import X`` works for every model.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from rft_core.algorithms import ADVANTAGE_ESTIMATORS
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.algorithms.value_loss import VALUE_LOSSES
from rft_core.config._base import _check_name, _Frozen, _tagged_union  # noqa: F401
from rft_core.config.algorithms import (  # noqa: F401
    ADVANTAGE_CONFIGS, POLICY_LOSS_CONFIGS, AdvantageConfig, CPGDAdvantage, CPGDLoss, DrGRPOAdvantage,
    DualClipLoss, DynamicSamplingConfig, GAEAdvantage, GRPOAdvantage, GSPOLoss, KLConfig, PolicyLossConfig,
    PPOClipLoss, ReinforceAdvantage, ReinforceBaselineAdvantage, RLOOAdvantage, ShapingConfig, TrainState,
    estimator_kwargs, policy_loss_kwargs)
from rft_core.config.rewards import (  # noqa: F401
    REWARD_SOURCE_CONFIGS, CodeExecSource, ExactMatchSource, FormatSource, MathAnswerSource, PythonSource,
    RecipeItem, RemoteSource, RewardConfig, RewardModelSource, RewardSourceConfig)
from rft_core.config.data import DataConfig, EvalConfig  # noqa: F401
from rft_core.config.generation import LogprobConfig, ModelConfig, RolloutConfig  # noqa: F401
from rft_core.config.run import CheckpointConfig, ObserveConfig, WandbConfig  # noqa: F401
from rft_core.config.scale import (  # noqa: F401
    RUNNABLE_STAGES, DeepSpeedConfig, LoraConfig, OrchestrationConfig, RunnerConfig, VLLMConfig)


class UpdateConfig(_Frozen):
    """PPO-style update of the policy: AdamW, micro-batches, gradient accumulation, clipping."""

    policy_loss: PolicyLossConfig = PPOClipLoss()
    loss_agg: str = "token-mean"
    loss_norm_tokens: int | None = Field(None, gt=0, description="constant of seq-mean-token-sum-norm (None: longest response)")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0)
    epochs: int = Field(1, gt=0)
    train_batch_size: int | None = Field(None, gt=0, description="sequences per optimizer step (None: the whole rollout)")
    micro_batch_size: int = Field(4, gt=0, description="sequences per forward/backward")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight")
    entropy_top_fraction: float | None = Field(None, gt=0, le=1, description="train only on this top fraction of tokens by entropy (arXiv:2506.01939); needs the actor stage")
    gradient_checkpointing: bool = False
    seed: int = 0
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (peft) instead of every weight")
    packing: bool = Field(False, description="pack each micro-batch into one row without padding")
    deepspeed: DeepSpeedConfig | None = Field(None, description="DeepSpeed ZeRO (multi-rank, under torchrun)")

    _a = field_validator("loss_agg")(lambda cls, v: _check_name(LOSS_AGGREGATIONS, v))


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
    seed: int = 0
    packing: bool = Field(False, description="pack each micro-batch into one row without padding (values and update)")
    deepspeed: DeepSpeedConfig | None = Field(None, description="DeepSpeed ZeRO for the critic update (multi-rank, under torchrun)")

    _v = field_validator("value_loss")(lambda cls, v: _check_name(VALUE_LOSSES, v))
    _a = field_validator("loss_agg")(lambda cls, v: _check_name(LOSS_AGGREGATIONS, v))

    @property
    def dtype(self) -> str:
        """dtype of the critic weights."""
        return self.model.dtype if self.model else "float32"


class TrainConfig(_Frozen):
    """A whole training run: N iterations under one run root."""

    name: str = "grpo"
    run_root: str = "runs/grpo"
    iterations: int = Field(2, gt=0)
    policy: ModelConfig = ModelConfig()
    reference: ModelConfig | None = Field(None, description="None: the initial policy")
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
    runners: dict[str, RunnerConfig] = Field(default_factory=dict, description=f"per stage ({', '.join(RUNNABLE_STAGES)}): where its program runs")

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
        """The runner of ``stage`` (in-process unless configured)."""
        return self.runners.get(stage, RunnerConfig())

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.update.entropy_top_fraction is not None and not self.logprobs.recompute_old_logprobs:
            raise ValueError("update.entropy_top_fraction needs the actor stage's entropies: set logprobs.recompute_old_logprobs=true")
        if self.update.train_batch_size is not None and self.update.train_batch_size < self.update.micro_batch_size:
            raise ValueError("update.train_batch_size must be >= update.micro_batch_size")
        return self

    def with_resolved_run_root(self, now: "_dt.datetime | None" = None) -> "TrainConfig":
        """A copy whose run_root has ``{timestamp}`` (YYYYmmdd-HHMMSS) and ``{name}`` filled in
        and, for a local path, is made absolute."""
        stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
        root = self.run_root.format(timestamp=stamp, name=self.name)
        if "://" not in root:
            root = str(Path(root).expanduser().resolve())
        return self.model_copy(update={"run_root": root})

    @property
    def needs_critic(self) -> bool:
        """True when the advantage estimator needs critic values (the critic stages run)."""
        return ADVANTAGE_ESTIMATORS.info(self.advantage.estimator).needs_critic

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
        lines = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" + (f" (got {e['input']!r})" if e["type"] == "unknown_name" else "")
                 for e in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
