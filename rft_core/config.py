"""Typed, frozen configs for every stage, composed into a training config.

YAML presets live in ``configs/``; any value can be overridden with dotted keys
(``rollout.temperature=0.7``) from the CLI or prefect.yaml. Unknown keys are errors.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from rft_core.algorithms import KL_ESTIMATORS
from rft_core.algorithms.policy_loss import LOSS_AGGREGATIONS
from rft_core.algorithms.value_loss import VALUE_LOSSES
from rft_core.models.loading import DEFAULT_MODEL


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_name(registry, value: str) -> str:
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; valid names: {', '.join(registry.names())}")
    return value


def _tagged_union(classes: tuple, key: str, default: str, kind: str):
    """A union of configs chosen by the field ``key`` (which may be left out: then ``default``).

    Each class's ``key`` is a Literal of one or more names; an unknown name fails with the list
    of valid names.
    """
    aliases = {name: c.model_fields[key].default for c in classes for name in c.model_fields[key].annotation.__args__}

    def tag_of(v: Any) -> str | None:
        name = v.get(key, default) if isinstance(v, dict) else getattr(v, key, default)
        return aliases.get(name, name)

    valid = ", ".join(aliases)
    return Annotated[
        Union[tuple(Annotated[c, Tag(c.model_fields[key].default)] for c in classes)],
        Discriminator(tag_of, custom_error_type="unknown_name",
                      custom_error_message=f"unknown {kind}; valid names: {valid}"),
    ]


class ModelConfig(_Frozen):
    """Which model to load: the embedded default alias, a local HF folder, or a hub id."""

    path: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "auto"] = Field("float32", description="auto: bfloat16 on a GPU that supports it, else float32")


class DataConfig(_Frozen):
    """Prompts from a reasoning-gym task (or the built-in ``humaneval``), seeded; each iteration
    takes the next slice."""

    source: Literal["reasoning_gym"] = "reasoning_gym"
    task: str = "basic_arithmetic"
    task_config: dict[str, int | float | str | bool] = Field(default_factory=dict)
    size: int = Field(2000, gt=0, description="number of distinct training prompts")
    seed: int = 1234
    prompts_per_iteration: int = Field(8, gt=0)
    system_prompt: str = (
        "You are a helpful assistant. Solve the problem. "
        "Give the final answer on the last line as: Answer: <answer>"
    )
    max_prompt_tokens: int = Field(256, gt=0)
    overlong_prompts: Literal["skip", "error"] = "skip"


class VLLMConfig(_Frozen):
    """vLLM engine settings (``rollout.engine=vllm``; GPU, its own environment: docs/scale.md)."""

    tensor_parallel_size: int = Field(1, gt=0)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    max_model_len: int | None = Field(None, gt=0)
    enable_sleep_mode: bool = Field(False, description="free GPU memory after the rollout (colocated with training)")
    max_lora_rank: int = Field(64, gt=0)


class RolloutConfig(_Frozen):
    """Sampling settings of the rollout engine."""

    engine: Literal["hf", "vllm"] = "hf"
    n_samples_per_prompt: int = Field(4, gt=0, description="group size G")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, gt=0)
    batch_size: int = Field(32, gt=0, description="sequences generated at once")
    first_token_temperature: float | None = Field(None, gt=0, description="FIRE sampling (arXiv:2410.21236): temperature of the first token only")
    seed: int = 0
    vllm: VLLMConfig | None = Field(None, description="engine=vllm settings (None: defaults)")


class _RewardSourceBase(_Frozen):
    on_error: Literal["raise", "fallback"] = Field(
        "raise", description="a source that raises or returns NaN/inf: stop the stage (raise) or give the "
        "sample `fallback` and count it in reward_metrics['<source>.fallback']")
    fallback: float = 0.0


class MathAnswerSource(_RewardSourceBase):
    """Correctness of the extracted final answer: the dataset's grader or math-verify."""

    type: Literal["math_answer"] = "math_answer"
    grader: Literal["dataset", "math_verify"] = "dataset"
    timeout_s: float = Field(5.0, gt=0, description="math_verify: per-sample wall-time limit (a worker process is killed past it)")


class ExactMatchSource(_RewardSourceBase):
    """1.0 when the extracted final answer equals the reference (stripped; optionally ignoring case)."""

    type: Literal["exact_match"] = "exact_match"
    ignore_case: bool = True


class FormatSource(_RewardSourceBase):
    """1.0 when the response gives its answer in an `Answer:` line or an <answer> tag."""

    type: Literal["format"] = "format"


class CodeExecSource(_RewardSourceBase):
    """Run the response against the problem's unit tests in a sandboxed subprocess."""

    type: Literal["code_exec"] = "code_exec"
    timeout_s: float = Field(5.0, gt=0, description="wall-time limit per sample (s)")
    memory_mb: int = Field(512, ge=64, description="address-space limit per sample (MiB)")
    max_workers: int | None = Field(None, gt=0, description="samples run at once (None: CPU count)")
    network: Literal["namespace", "audit"] = Field(
        "namespace", description="namespace: a network namespace (unshare) plus the audit hook; audit: the audit hook only")


class RewardModelSource(_RewardSourceBase):
    """A local HF sequence-classification model; score = logit 0 of prompt+response."""

    type: Literal["reward_model"] = "reward_model"
    path: str
    batch_size: int = Field(8, gt=0)
    max_length: int = Field(1024, gt=0, description="tokens; longer inputs keep their end")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"


class RemoteSource(_RewardSourceBase):
    """A remote reward model: POST {queries, prompts, labels, references} -> {rewards}."""

    type: Literal["remote"] = "remote"
    url: str
    timeout_s: float = Field(30.0, gt=0, description="connect and read timeout per request (s)")
    retries: int = Field(3, ge=0, description="retries on connection errors, timeouts and HTTP 429/5xx")
    backoff_s: float = Field(0.5, ge=0, description="backoff factor: waits backoff_s * 2**(n-1) before retry n")
    batch_size: int = Field(64, gt=0, description="samples per request")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {v!r}")
        return v


class PythonSource(_RewardSourceBase):
    """A user's function, given as `module:function` or `path/to/file.py:function`."""

    type: Literal["python"] = "python"
    function: str
    call: Literal["sample", "batch", "lightrft"] = Field(
        "sample", description="sample: fn(sample) -> float | (float, reason); batch: fn(samples) -> list; "
        "lightrft: fn(queries, prompts, labels) -> list")

    @field_validator("function")
    @classmethod
    def _spec(cls, v: str) -> str:
        if ":" not in v or not v.rsplit(":", 1)[1].isidentifier():
            raise ValueError(f"function must be 'module:function' or 'path/to/file.py:function', got {v!r}")
        return v


REWARD_SOURCE_CONFIGS = (MathAnswerSource, ExactMatchSource, FormatSource, CodeExecSource, RewardModelSource, RemoteSource, PythonSource)
RewardSourceConfig = _tagged_union(REWARD_SOURCE_CONFIGS, "type", "math_answer", "reward source type")


class RecipeItem(_Frozen):
    """One term of a recipe: ``weight`` times the score of the named source. A weight of 0 still
    computes and logs the score; leave the item out to skip the source."""

    source: str
    weight: float = 1.0


class RewardConfig(_Frozen):
    """The reward engine: named sources, and per-label recipes that weight them.

    With ``sources`` left empty the shorthand keys build the implicit recipe
    ``correct_reward * correctness + format_reward * format`` for every label.
    """

    grader: Literal["dataset", "math_verify"] = "dataset"
    correct_reward: float = 1.0
    format_reward: float = Field(0.0, description="added when the response ends with an 'Answer:' line or <answer> tag")
    sources: dict[str, RewardSourceConfig] = Field(default_factory=dict, description="name -> source")
    recipes: dict[str, list[RecipeItem]] = Field(default_factory=dict, description="label -> [(source, weight)]")
    label_field: Literal["data_source"] = Field("data_source", description="the prompt column that picks a sample's recipe")
    default_recipe: str | None = Field(None, description="recipe for labels that have none (None: such a label is an error)")
    aggregation: str = Field("weighted_sum", description="weighted_sum, or 'module:function' called as fn(scores, weights, sample)")

    @model_validator(mode="after")
    def _check_recipes(self) -> "RewardConfig":
        if not self.sources:
            if self.recipes or self.default_recipe is not None:
                raise ValueError("reward.recipes need reward.sources")
            return self
        if (self.grader, self.correct_reward, self.format_reward) != ("dataset", 1.0, 0.0):
            raise ValueError("reward.grader/correct_reward/format_reward are shorthand for the implicit recipe; "
                             "with reward.sources set, give weights in reward.recipes instead")
        if not self.recipes:
            raise ValueError("reward.sources is set but reward.recipes is empty")
        for label, items in self.recipes.items():
            if not items:
                raise ValueError(f"reward.recipes.{label} is empty")
            for item in items:
                if item.source not in self.sources:
                    raise ValueError(f"reward.recipes.{label} uses source {item.source!r}, which is not in "
                                     f"reward.sources (defined: {', '.join(self.sources)})")
        if self.default_recipe is not None and self.default_recipe not in self.recipes:
            raise ValueError(f"reward.default_recipe {self.default_recipe!r} is not a recipe (defined: {', '.join(self.recipes)})")
        return self

    @property
    def resolved(self) -> "RewardConfig":
        """This config with the shorthand expanded into explicit sources and one default recipe."""
        if self.sources:
            return self
        sources = {"correctness": MathAnswerSource(grader=self.grader), "format": FormatSource()}
        recipe = [RecipeItem(source="correctness", weight=self.correct_reward),
                  RecipeItem(source="format", weight=self.format_reward)]  # weight 0: still logged
        return RewardConfig.model_construct(
            grader="dataset", correct_reward=1.0, format_reward=0.0, sources=sources, recipes={"default": recipe},
            label_field="data_source", default_recipe="default", aggregation=self.aggregation)


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
# estimators that need critic values (and so the critic stage)
NEEDS_CRITIC = frozenset({"gae"})


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


class LogprobConfig(_Frozen):
    """Per-token log-prob computation (actor and reference stages)."""

    micro_batch_size: int = Field(8, gt=0, description="sequences per forward pass")
    recompute_old_logprobs: bool = Field(
        True, description="False: reuse the rollout engine's own log-probs and skip the actor stage"
    )
    packing: bool = Field(False, description="pack each micro-batch into one row without padding (position ids restart per sequence)")


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


class LoraConfig(_Frozen):
    """LoRA adapters through peft (Hu et al. 2021, arXiv:2106.09685): W + (alpha / rank) * B A."""

    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names, or all-linear: every Linear of attention and MLP (not the LM head)")


class DeepSpeedConfig(_Frozen):
    """DeepSpeed ZeRO data parallelism for the update; launch it with torchrun
    (``runners.ppo_update: {mode: subprocess, launcher: torchrun, nproc_per_node: N}``)."""

    zero_stage: Literal[1, 2, 3] = 2
    offload_optimizer: bool = Field(False, description="ZeRO-Offload of the optimizer state to CPU memory")
    torch_adam: bool = Field(True, description="torch's AdamW instead of DeepSpeed's compiled Adam ops")


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


def policy_loss_kwargs(cfg: "PolicyLossConfig") -> dict[str, Any]:
    """The keyword arguments of the chosen policy loss function (every field but its name)."""
    return cfg.model_dump(exclude={"name"})


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

    _v = field_validator("value_loss")(lambda cls, v: _check_name(VALUE_LOSSES, v))
    _a = field_validator("loss_agg")(lambda cls, v: _check_name(LOSS_AGGREGATIONS, v))

    @property
    def dtype(self) -> str:
        """dtype of the critic weights."""
        return self.model.dtype if self.model else "float32"


class EvalConfig(_Frozen):
    """Held-out evaluation (``flows/eval.py``): greedy decoding on prompts of the training task
    whose question texts never occur in the training dataset (``heldout_entries``)."""

    num_prompts: int = Field(200, gt=0, description="held-out prompts, one greedy response each")
    seed: int | None = Field(None, description="dataset seed of the held-out split; None: data.seed + data.size + 1000003")
    max_new_tokens: int | None = Field(None, gt=0, description="None: rollout.max_new_tokens")
    batch_size: int = Field(32, gt=0, description="sequences generated at once")


# Stages whose program can run in a subprocess (another interpreter, torchrun): those holding a model.
RUNNABLE_STAGES = ("rollout", "actor_logprobs", "ref_logprobs", "critic_values", "critic_update", "ppo_update")


class RunnerConfig(_Frozen):
    """Where a stage program runs: in the task's process (default) or as
    ``python -m rft_core.stages <stage>`` in a subprocess, with another interpreter (e.g. a vLLM
    environment) and optionally under torchrun (multi-rank update). Never part of a config hash:
    both modes commit the same shard."""

    mode: Literal["inprocess", "subprocess"] = "inprocess"
    python: str | None = Field(None, description="interpreter of the subprocess (None: the current one)")
    launcher: Literal["plain", "torchrun"] = "plain"
    nproc_per_node: int = Field(1, gt=0, description="torchrun: ranks on this node")
    torchrun_args: list[str] = Field(default_factory=list, description="extra torchrun flags, e.g. --nnodes=2 --rdzv-endpoint=host:29500")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of the subprocess")
    tail_lines: int = Field(40, gt=0, description="output lines quoted in the error of a failed subprocess")
    shards: int = Field(1, gt=0, description="rollout only: split over this many Prefect tasks on a Ray cluster (prefect-ray)")
    ray_address: str | None = Field(None, description="Ray cluster for shards > 1 (ray://host:10001, auto); None: start a local one")
    ray_init_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra ray.init arguments (num_cpus, runtime_env, ...)")
    ray_remote_options: dict[str, Any] = Field(default_factory=dict, description="Ray resources of each shard task, e.g. {num_gpus: 1}")

    @model_validator(mode="after")
    def _check(self) -> "RunnerConfig":
        if self.mode == "inprocess" and (self.launcher != "plain" or self.python):
            raise ValueError("runner.launcher / runner.python need runner.mode=subprocess")
        return self


class WandbConfig(_Frozen):
    """Optional Weights & Biases logging of the per-iteration metrics (needs ``pip install wandb``)."""

    enabled: bool = False
    project: str = "prefect-rft"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description="None: wandb's own default (WANDB_MODE)")
    tags: list[str] = Field(default_factory=list)


class ObserveConfig(_Frozen):
    """Where metrics go besides metrics.jsonl, TensorBoard and the Prefect artifacts."""

    wandb: WandbConfig = WandbConfig()


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
        return self.advantage.estimator in NEEDS_CRITIC

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
