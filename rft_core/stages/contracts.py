"""Stage contracts: one typed input model per stage program, defined once.

A stage's input model is what its Prefect task takes (``tasks.stages``), what its program
takes (``rft_core.stages.<module>.run``), what crosses a process boundary when the program runs
as ``python -m rft_core.stages <program>`` (JSON of the model, validated on the other side),
and what its config hash is computed from. Models are frozen pydantic models: constructed with
keywords only, unknown fields rejected.

The config hash (``StageInput.config_hash``) is the sha256 of the canonical JSON of the fields
by name, leaving out the fields in ``unhashed`` (where the output goes, how it is written) and
every field, at any depth of a nested config, whose value equals its default; a config section
contributes its class name and its non-default fields, but those its class lists in its own
``unhashed`` (how to reach a service, never what it computes: the LLM judge's ``base_url``); a
ShardRef contributes its manifest's sha256. So reordering fields, or adding a field with a default, leaves every hash as it was,
and a run resumes across such changes.

What does change a hash is the contract id, ``"<program> v<version>"``, recorded in every
manifest. Bump a program's ``version`` when the meaning of an existing field or default
changes (a default that moves would otherwise hash like the old one): committed stages of the
older contract are then refused as written by another version (``schemas.OlderVersionError``),
never silently reused. ``tests/rft_core/stages/test_contracts.py`` pins the defaults of every
config section so that such a change cannot go unnoticed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rft_core.config import (
    AdvantageConfig,
    CriticConfig,
    DataConfig,
    EvalConfig,
    KLConfig,
    LogprobConfig,
    RewardConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    ShapingConfig,
    TeacherConfig,
    TrainState,
    UpdateConfig,
    UpdateGrouping,
)
from schemas import PolicyRef, ShardRef, config_hash


__all__ = ["PROGRAMS", "STAGE_INPUTS", "ActorLogprobsInput", "AdvantagesInput", "CriticUpdateInput", "CriticValuesInput",
           "DynamicMergeInput", "EvalGenerateInput", "EvalPromptsInput", "EvalSummaryInput", "LogprobsInput",
           "OptimizerStateInput", "PPOUpdateInput", "PolicyCheckpointInput", "PromptsInput", "RefLogprobsInput", "RewardsInput", "RolloutInput",
           "RolloutMergeInput", "StageInput", "TeacherLogprobsInput", "hash_value", "stage_program"]


def hash_value(value: Any) -> Any:
    """The canonical, JSON-able form of a field value for config hashes: a ShardRef is its
    manifest sha256, a pydantic model its class name plus its non-default fields (recursively)
    but those its class lists in ``unhashed`` (a config section's fields that say how to reach a
    service, not what it computes: ``LLMJudgeSource.unhashed``), mappings and sequences element-wise."""
    if isinstance(value, ShardRef):
        return {"shard": value.manifest_sha256}
    if isinstance(value, BaseModel):
        return {"type": type(value).__name__, **_non_default_fields(value, getattr(type(value), "unhashed", frozenset()))}
    if isinstance(value, Mapping):
        return {str(k): hash_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [hash_value(v) for v in value]
    return value


def _non_default_fields(model: BaseModel, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    out = {}
    for name, field in type(model).model_fields.items():
        if name in skip:
            continue
        value = getattr(model, name)
        if not field.is_required() and value == field.get_default(call_default_factory=True):
            continue
        out[name] = hash_value(value)
    return out


class StageInput(BaseModel):
    """Base of the stage input models (see the module docstring).

    Class attributes: ``program`` (its name in ``rft_core.stages.runner.PROGRAMS`` and on the
    command line), ``stage`` (the stage whose shard it commits), ``version`` (of the contract),
    ``unhashed`` (fields outside the config hash), ``config_paths`` (field -> attribute path in
    a ``TrainConfig``: how ``python -m rft_core.stages <program> --config`` fills the fields not
    given), ``holds_model`` (the program loads a model: ``run_in_process`` gives the CUDA cache
    back after it, unless a resident worker keeps it).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    program: ClassVar[str]
    stage: ClassVar[str]
    version: ClassVar[int] = 1
    unhashed: ClassVar[frozenset[str]] = frozenset({"out"})
    config_paths: ClassVar[Mapping[str, str]] = {}
    holds_model: ClassVar[bool] = False

    out: str = Field(description="URI of the stage's output folder (any fsspec URI)")

    @property
    def contract(self) -> str:
        """The contract id recorded in the manifest: ``"<program> v<version>"``."""
        return f"{self.program} v{self.version}"

    def hash_view(self) -> dict[str, Any]:
        """The fields that make up the config hash, canonical (see ``hash_value``)."""
        return _non_default_fields(self, self.unhashed)

    def config_hash(self, **derived: Any) -> str:
        """sha256 (hex, 16 chars) of the contract id, ``hash_view()`` and ``derived``: values the
        program derives from its inputs that also determine its output (None entries left out),
        e.g. the optimizer stage an update continues or the source files of user reward code."""
        extra = {k: hash_value(v) for k, v in derived.items() if v is not None}
        return config_hash(self.contract, self.hash_view(), extra)


class PromptsInput(StageInput):
    """The iteration's prompts: the dataset slice of ``iteration`` (or a dynamic-sampling refill
    ``attempt`` >= 1), chat-templated and tokenized."""

    program: ClassVar[str] = "prompts"
    stage: ClassVar[str] = "prompts"
    version: ClassVar[int] = 3  # 2: prompts schema v3, a videos column (issue 21); 3: GSM8K `#### N` answers read as N
    # answer_required is outside the hash: it only lets rows without an answer through (which
    # failed before), so every stage it could have committed both ways is the same
    unhashed: ClassVar[frozenset[str]] = frozenset({"out", "answer_required"})
    config_paths: ClassVar[Mapping[str, str]] = {"data": "data", "tokenizer_path": "policy.path",
                                                 "answer_required": "reward.needs_reference"}
    data: DataConfig
    tokenizer_path: str
    iteration: int = Field(ge=1)
    attempt: int = Field(0, ge=0)
    data_fingerprint: str | None = Field(None, description="size and version of the dataset files (data.source=files): "
                                         "an edited dataset makes committed prompts stale")
    answer_required: bool = Field(True, description="data.source=files: every row needs a reference answer (False when "
                                  "the grader reads none, RewardConfig.needs_reference: the answer is then '' where absent)")
    carry: ShardRef | None = Field(None, description="rollout.partial: the previous iteration's rollout; the prompt rows of "
                                   "the groups it carries (carry/prompts.parquet) follow this iteration's own")


class RolloutInput(StageInput):
    """A group of ``rollout.n_samples_per_prompt`` responses per prompt from ``policy``, the
    policy of version ``policy_version`` (recorded in every row and in the manifest).

    ``shard`` (index, count): only the engine batches b with b % count == index (the Ray
    fan-out); the merge of all ``count`` shards equals the whole rollout.

    ``greedy``: one greedy (argmax) response per prompt instead (``rollout.n_samples_per_prompt``,
    the temperatures, top-p and the seed play no part): the baseline of ReMax, written to the
    ``baseline_rollout`` stage folder. Left at False it enters no hash, so every committed rollout
    stays valid.

    ``carry`` (``rollout.partial``): the previous iteration's rollout, whose carried sequences this
    one continues (its manifest's sha256 enters the hash). Left at None (and ``rollout.partial``
    unset) it enters no hash either.
    """

    program: ClassVar[str] = "rollout"
    holds_model: ClassVar[bool] = True
    stage: ClassVar[str] = "rollout"
    # 2: rollout schema v3 (videos); HF log-probs under the processed distribution (issue 21)
    # 3: rollout schema v4 (multi-turn trajectory columns; rollout.agent, issue 20)
    # 4: the HF engine draws by inverse CDF in its own decode loop: another random stream (issue 19)
    # 5: rollout schema v5, the policy_version column (asynchronous RL, issue 28); 6: the HF engine draws a
    # uniform per batch row at every step, finished rows included (a row's samples no longer depend on others' ends)
    version: ClassVar[int] = 6
    config_paths: ClassVar[Mapping[str, str]] = {"rollout": "rollout", "policy": "policy.path", "dtype": "policy.dtype"}
    prompts: ShardRef
    policy: PolicyRef
    rollout: RolloutConfig
    iteration: int = Field(ge=1)
    dtype: str = "float32"
    attempt: int = Field(0, ge=0)
    shard: tuple[int, int] | None = None
    policy_version: int = Field(0, ge=0, description="the update whose policy ``policy`` is (0: the initial policy; "
                                "TrainConfig.rollout_policy_version)")
    greedy: bool = Field(False, description="one greedy response per prompt (ReMax's baseline) instead of the sampled group")
    carry: ShardRef | None = Field(None, description="rollout.partial: the previous iteration's rollout, whose carried "
                                   "sequences (carry/) this rollout continues; None: the first iteration")

    @model_validator(mode="after")
    def _check_shard(self) -> "RolloutInput":
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise ValueError(f"rollout shard index {self.shard[0]} is not in 0..{self.shard[1] - 1}")
        if self.greedy and self.rollout.agent is not None:
            raise ValueError("a greedy (baseline) rollout is single-turn: rollout.agent must be unset")
        if self.carry is not None and (self.rollout.partial is None or self.greedy):
            raise ValueError("rollout carry: only a partial rollout (rollout.partial, not greedy) continues carried sequences")
        if self.rollout.partial is not None and self.shard is not None:
            raise ValueError("rollout.partial: a partial rollout is not sharded (runners.rollout.shards must be 1)")
        return self


class RolloutMergeInput(StageInput):
    """The rollout of ``rollout`` (unsharded) from its committed shards ``parts``; committed
    under the unsharded rollout's own contract and config hash, so either stands for the other."""

    program: ClassVar[str] = "rollout_merge"
    stage: ClassVar[str] = "rollout"
    rollout: RolloutInput
    parts: list[ShardRef] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> "RolloutMergeInput":
        if self.rollout.shard is not None or self.rollout.out != self.out:
            raise ValueError("rollout_merge: `rollout` must be the unsharded rollout input writing to `out`")
        return self

    @property
    def contract(self) -> str:
        return self.rollout.contract

    def config_hash(self, **derived: Any) -> str:
        return self.rollout.config_hash(**derived)


class LogprobsInput(StageInput):
    """Per-token log-probs of the rollout's responses under ``model`` at ``temperature``."""

    version: ClassVar[int] = 2  # 2: logprobs.packing true and recompute_old_logprobs auto by default (issue 19)
    holds_model: ClassVar[bool] = True
    rollout: ShardRef
    model: PolicyRef
    logprobs: LogprobConfig
    temperature: float = Field(gt=0)
    dtype: str = "float32"
    grouping: UpdateGrouping | None = Field(None, description="the update's micro-batches instead of length-sorted ones "
                                            "(below float32: TrainConfig.logprob_grouping); None enters no hash")


class ActorLogprobsInput(LogprobsInput):
    """``old_logprobs`` (and ``action_entropy``) under the policy before the update; with
    ``with_sum_pi_squared`` also ``sum_pi_squared`` (sum_v pi_old(v)^2 at each response token, the
    optional column of ``schemas.columns.ACTOR_LOGPROBS``; the optimal token baseline's input).
    Left at False it enters no hash, so every committed actor stage stays valid."""

    program: ClassVar[str] = "actor_logprobs"
    stage: ClassVar[str] = "actor_logprobs"
    config_paths: ClassVar[Mapping[str, str]] = {"logprobs": "logprobs", "model": "policy.path", "dtype": "policy.dtype",
                                                 "temperature": "rollout.temperature", "grouping": "logprob_grouping",
                                                 "with_sum_pi_squared": "needs_sum_pi_squared"}
    with_sum_pi_squared: bool = Field(False, description="also write sum_pi_squared: sum_v softmax(logits / temperature)_v^2 "
                                      "at each response token (TrainConfig.needs_sum_pi_squared: optimal_token_baseline)")


class RefLogprobsInput(LogprobsInput):
    """``ref_logprobs`` under the reference model."""

    program: ClassVar[str] = "ref_logprobs"
    stage: ClassVar[str] = "ref_logprobs"
    config_paths: ClassVar[Mapping[str, str]] = {"logprobs": "logprobs", "model": "reference_model.path",
                                                 "dtype": "reference_model.dtype", "temperature": "rollout.temperature",
                                                 "grouping": "logprob_grouping"}


class TeacherLogprobsInput(LogprobsInput):
    """``teacher_logprobs``: log nu(y_t) of every response token under the teacher ``model``
    (on-policy distillation, ``TrainConfig.teacher``), its logits divided by ``temperature``
    (``TrainConfig.teacher_temperature``: ``teacher.temperature``, or the rollout's).
    ``tokenizer_path``: the policy's tokenizer (``policy.path``), which the rollout's token ids
    are in; a teacher with another tokenizer is refused before anything is
    computed (``rft_core.stages.teacher.check_teacher_tokenizer``). No ``grouping``: the teacher is
    not the model the update trains."""

    program: ClassVar[str] = "teacher_logprobs"
    stage: ClassVar[str] = "teacher_logprobs"
    version: ClassVar[int] = 1
    config_paths: ClassVar[Mapping[str, str]] = {"logprobs": "logprobs", "model": "teacher.path", "dtype": "teacher.dtype",
                                                 "temperature": "teacher_temperature", "tokenizer_path": "policy.path"}
    tokenizer_path: str = Field(description="the policy's tokenizer (policy.path): the rollout's token ids are its ids")

    @model_validator(mode="after")
    def _check_grouping(self) -> "TeacherLogprobsInput":
        if self.grouping is not None:
            raise ValueError("teacher_logprobs: grouping is the update's micro-batching of the policy's own passes; the "
                             "teacher's pass takes none")
        return self


class RewardsInput(StageInput):
    """Every response of the rollout scored by the reward engine."""

    program: ClassVar[str] = "rewards"
    stage: ClassVar[str] = "rewards"
    version: ClassVar[int] = 2  # 2: math_verify grades math-verify's own extraction (\boxed{} etc., issue 30)
    config_paths: ClassVar[Mapping[str, str]] = {"reward": "reward"}
    rollout: ShardRef
    prompts: ShardRef
    reward: RewardConfig


class AdvantagesInput(StageInput):
    """Rewards shaped (with the KL to the reference when ``ref_logprobs`` is given) and turned
    into advantages; ``kl.kl_coef`` is this iteration's coefficient (``state.kl_coef``).
    ``baseline_rollout`` / ``baseline_rewards`` (both or neither): the greedy response of each
    prompt and its reward, for an estimator with a greedy baseline (remax). ``rollout_correction``:
    the update's rollout correction, for an estimator that weighs its baseline by the importance
    weights (``EstimatorInfo.needs_sum_pi_squared``: optimal_token_baseline;
    ``TrainConfig.advantage_rollout_correction``). Left out, they enter no hash."""

    program: ClassVar[str] = "advantages"
    stage: ClassVar[str] = "advantages"
    # 2: the KL penalty of group-normalised estimators after normalisation (issue 16); 3: gae advantages whitened
    # by default (advantage.whiten), discounted returns count action tokens only (multi-turn, gamma < 1) (issue 29);
    # 4: the optimal token baseline's handle_zero_tail on by default and its positions counted in action tokens (issue 38)
    version: ClassVar[int] = 4
    config_paths: ClassVar[Mapping[str, str]] = {"kl": "kl", "advantage": "advantage", "shaping": "shaping",
                                                 "state": "initial_state", "max_new_tokens": "rollout.max_new_tokens",
                                                 "rollout_correction": "advantage_rollout_correction",
                                                 "teacher": "teacher"}
    rollout: ShardRef
    rewards: ShardRef
    actor_logprobs: ShardRef | None = None
    ref_logprobs: ShardRef | None = None
    critic_values: ShardRef | None = None
    # the greedy response of each prompt and its reward (estimators with EstimatorInfo.greedy_baseline: remax)
    baseline_rollout: ShardRef | None = None
    baseline_rewards: ShardRef | None = None
    kl: KLConfig
    advantage: AdvantageConfig
    shaping: ShapingConfig = ShapingConfig()
    state: TrainState
    max_new_tokens: int | None = Field(None, gt=0)
    rollout_correction: RolloutCorrectionConfig | None = Field(
        None, description="the update's rollout correction (enabled), whose weights the optimal token baseline squares "
        "into its token weights; None: no weights")
    # on-policy distillation: the teacher stage's log-probs and the teacher section (coef, use_task_rewards)
    teacher_logprobs: ShardRef | None = None
    teacher: TeacherConfig | None = Field(None, description="distillation (teacher.path set): the weight of the "
                                          "per-token signal and whether the task advantages stay; None: none")

    @model_validator(mode="before")
    @classmethod
    def _no_teacher_when_off(cls, data: Any) -> Any:
        """A teacher section without a path (distillation off) is no teacher: None, which enters no hash."""
        if isinstance(data, dict):
            t = data.get("teacher")
            path = t.get("path") if isinstance(t, dict) else getattr(t, "path", "")
            if t is not None and path is None:
                data = {**data, "teacher": None}
        return data

    @model_validator(mode="after")
    def _check_baseline(self) -> "AdvantagesInput":
        if (self.baseline_rollout is None) != (self.baseline_rewards is None):
            raise ValueError("advantages: baseline_rollout and baseline_rewards go together (the greedy responses and "
                             "their rewards)")
        if (self.teacher_logprobs is None) != (self.teacher is None or not self.teacher.enabled):
            raise ValueError("advantages: teacher_logprobs (the teacher stage's shard) and teacher (a TeacherConfig with "
                             "its path set) go together: distillation needs both")
        return self


class CriticValuesInput(StageInput):
    """V(s_t) of every response token under the critic ``model``."""

    program: ClassVar[str] = "critic_values"
    holds_model: ClassVar[bool] = True
    stage: ClassVar[str] = "critic_values"
    config_paths: ClassVar[Mapping[str, str]] = {"critic": "critic", "model": "initial_critic"}
    rollout: ShardRef
    model: PolicyRef
    critic: CriticConfig


class CriticUpdateInput(StageInput):
    """The critic ``model`` trained on the advantage stage's returns."""

    program: ClassVar[str] = "critic_update"
    holds_model: ClassVar[bool] = True
    stage: ClassVar[str] = "critic_update"
    # 2: dropout off in the critic update (issue 16); 3: a bfloat16 critic trains on bf16 weights with float32
    # masters and gradients instead of autocast over float32 weights (issue 29)
    version: ClassVar[int] = 3
    config_paths: ClassVar[Mapping[str, str]] = {"critic": "critic", "model": "initial_critic"}
    rollout: ShardRef
    advantages: ShardRef
    critic_values: ShardRef
    model: PolicyRef
    critic: CriticConfig


class PPOUpdateInput(StageInput):
    """The policy update; ``background_optimizer``: its AdamW state is written by a background
    thread (how it is written, not what: outside the hash); ``save_checkpoint`` (outside the
    hash too: the update computes the same either way) whether the weights go to storage. ``ref_logprobs`` enter the hash only
    when the KL is a loss term (the only case the update reads them)."""

    program: ClassVar[str] = "ppo_update"
    holds_model: ClassVar[bool] = True
    stage: ClassVar[str] = "ppo_update"
    # 2: loss normalisers, dropout off, rollout correction (issue 16); 3: update.packing true, fused AdamW,
    # old log-probs from the engine where on-policy (issue 19); 4: the k1+/k3+ KL loss keeps k2's gradient past
    # |log pi - log ref| = sqrt(2 kl_clamp), saturating at kl_clamp (issue 29)
    # 5: bf16 forward/backward on the bfloat16 weights, float32 master grads (issue 29); 6: the update's random draws
    # seeded by update.seed (LoRA's initial A matrices, LoRA / model dropout masks), the entropy bonus never masked by
    # the rollout correction (issue 39); 7: the micro-batch order and the dropout masks mix policy_version (and the
    # DeepSpeed or FSDP2 rank, for the masks) into update.seed, so each iteration draws its own (issue 46); 8: the
    # optimizer state it continues enters the hash as its stage's config hash, not its manifest's sha256 (known before
    # the background write ends: optimizer_state_key, issue 44)
    version: ClassVar[int] = 8
    unhashed: ClassVar[frozenset[str]] = frozenset({"out", "background_optimizer", "save_checkpoint",
                                                    "background_checkpoint"})
    config_paths: ClassVar[Mapping[str, str]] = {"update": "update", "kl": "kl", "policy": "policy.path",
                                                 "dtype": "policy.dtype", "temperature": "rollout.temperature"}
    rollout: ShardRef
    advantages: ShardRef
    actor_logprobs: ShardRef | None = None
    ref_logprobs: ShardRef | None = None
    policy: PolicyRef
    update: UpdateConfig
    kl: KLConfig
    temperature: float = Field(gt=0)
    dtype: str = "float32"
    background_optimizer: bool = False
    save_checkpoint: bool = Field(True, description="write the new weights and AdamW state (checkpoint.every); False: "
                                  "a resident worker, or stage mode keeping its models (orchestration.keep_models), keeps them "
                                  "in memory and the manifest records their digest")
    policy_version: int | None = Field(None, ge=0, description="the version ``policy`` is (the iteration whose update "
                                       "made it; 0: the initial policy; None: 0), recorded in the manifest; with "
                                       "update.seed it seeds the update's micro-batch order and dropout masks "
                                       "(rft_core.training.update.update_seeds), so it enters the config hash")
    background_checkpoint: bool = Field(False, description="with save_checkpoint, in one process whose trainer stays "
                                        "in memory (a resident worker, or stage mode keeping its models): "
                                        "commit the update as between checkpoints (the weights' digest, no weights) and "
                                        "write the weights and AdamW state in the background as the sibling stages "
                                        "``{out}-policy`` and ``{out}-optimizer`` (checkpoint.async_weights)")

    def hash_view(self) -> dict[str, Any]:
        view = super().hash_view()
        if not self.kl.in_loss:
            view.pop("ref_logprobs", None)
        return view


class OptimizerStateInput(StageInput):
    """The policy's AdamW state after the committed ``update``, as the sibling stage
    ``{update}-optimizer`` (written by the update itself; ``rft_core.stages.optimizer_state``)."""

    program: ClassVar[str] = "optimizer_state"
    stage: ClassVar[str] = "optimizer_state"
    update: ShardRef


class PolicyCheckpointInput(StageInput):
    """The policy's weights after the committed ``update``, as the sibling stage ``{update}-policy``
    (a resident checkpoint iteration writes them in the background after committing ``update``;
    ``rft_core.stages.optimizer_state``)."""

    program: ClassVar[str] = "policy_checkpoint"
    stage: ClassVar[str] = "policy_checkpoint"
    update: ShardRef


class DynamicMergeInput(StageInput):
    """Dynamic sampling: the kept groups of the (prompts, rollout, rewards) ``attempts`` as the
    iteration's prompts (at ``out``), rollout (``out_rollout``) and rewards (``out_rewards``)."""

    program: ClassVar[str] = "dynamic_merge"
    stage: ClassVar[str] = "prompts"
    # 2: writes prompts / rollout schema v3 (videos; issue 21); 3: rollout schema v4 (issue 20); 4: rollout v5 (issue 28)
    version: ClassVar[int] = 4
    unhashed: ClassVar[frozenset[str]] = frozenset({"out", "out_rollout", "out_rewards"})
    attempts: list[tuple[ShardRef, ShardRef, ShardRef]] = Field(min_length=1)
    target_groups: int = Field(gt=0)
    out_rollout: str
    out_rewards: str


class EvalPromptsInput(StageInput):
    """Held-out prompts of the training task (question texts disjoint from the training data)."""

    program: ClassVar[str] = "eval_prompts"
    stage: ClassVar[str] = "prompts"
    version: ClassVar[int] = 3  # 2: prompts schema v3 (videos); held-out disjoint by question and media (issue 21);
    # 3: GSM8K `#### N` answers read as N
    unhashed: ClassVar[frozenset[str]] = frozenset({"out", "answer_required"})  # as PromptsInput
    config_paths: ClassVar[Mapping[str, str]] = {"data": "data", "eval": "eval", "tokenizer_path": "policy.path",
                                                 "answer_required": "reward.needs_reference"}
    data: DataConfig
    eval: EvalConfig
    tokenizer_path: str
    data_fingerprint: str | None = Field(None, description="size and version of the held-out dataset files (eval.path)")
    answer_required: bool = Field(True, description="eval.path: every row needs a reference answer (as PromptsInput)")


class EvalGenerateInput(StageInput):
    """One greedy response per held-out prompt, or (``temperature`` set) ``n_samples`` sampled
    ones. The sampling fields default to greedy decoding, so a greedy stage's config hash is
    the one it had before they existed."""

    program: ClassVar[str] = "eval_generate"
    holds_model: ClassVar[bool] = True
    stage: ClassVar[str] = "rollout"
    # 2: rollout schema v3 (videos); vision-language policies (issue 21); 3: rollout v4 (issue 20);
    # 4: greedy decoding in the HF engine's own loop (issue 19); 5: rollout schema v5 (policy_version null, issue 28)
    # (not bumped for the HF engine's per-row uniforms, rollout v6: greedy evals are unchanged and keep their hash)
    version: ClassVar[int] = 5
    config_paths: ClassVar[Mapping[str, str]] = {"policy": "policy.path", "dtype": "policy.dtype",
                                                 "batch_size": "eval.batch_size", "n_samples": "eval.n_samples",
                                                 "seed": "eval.sampling_seed"}  # temperature, top_p: --arg
    prompts: ShardRef
    policy: PolicyRef
    max_new_tokens: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    dtype: str = "float32"
    n_samples: int = Field(1, gt=0, description="responses per prompt (> 1 needs a temperature)")
    temperature: float | None = Field(None, gt=0, description="sampling temperature; None: greedy decoding")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (sampled decoding only)")
    seed: int = Field(0, description="seed of the sampled responses (greedy decoding uses none)")

    @model_validator(mode="after")
    def _check_sampling(self) -> "EvalGenerateInput":
        if self.temperature is None and (self.n_samples > 1 or self.top_p != 1.0):
            raise ValueError(f"n_samples={self.n_samples}, top_p={self.top_p:g} need a sampling temperature "
                             "(temperature is None: greedy decoding, one response per prompt)")
        return self


class EvalSummaryInput(StageInput):
    """Prompts, responses and rewards joined per sample: accuracy and mean reward; for sampled
    responses (``sampled``) also avg@n, pass@1..n and maj@n per data_source and overall. The
    defaults are the greedy summary, whose config hash is the one it had before they existed."""

    program: ClassVar[str] = "eval_summary"
    stage: ClassVar[str] = "eval"
    config_paths: ClassVar[Mapping[str, str]] = {"policy": "policy.path", "n_samples": "eval.n_samples",
                                                 "sampled": "eval.sampled"}
    prompts: ShardRef
    rollout: ShardRef
    rewards: ShardRef
    policy: PolicyRef
    n_samples: int = Field(1, gt=0, description="responses per prompt the rollout must hold")
    sampled: bool = Field(False, description="the responses were sampled (EvalGenerateInput.temperature set)")

    @model_validator(mode="after")
    def _check_sampled(self) -> "EvalSummaryInput":
        if self.n_samples > 1 and not self.sampled:
            raise ValueError(f"n_samples={self.n_samples} with sampled=false: greedy decoding gives one response per prompt")
        return self


# program name -> its function (each stage module registers its programs with ``stage_program``)
PROGRAMS: dict[str, Callable[[Any], Any]] = {}
F = TypeVar("F", bound=Callable[..., Any])


def stage_program(*inputs: type[StageInput]) -> Callable[[F], F]:
    """Register the decorated function as the program of each input model in ``inputs`` (what
    ``rft_core.stages.runner.run_stage`` calls for them, in-process or as a subprocess).

    Raises:
        ValueError: a program name is registered twice.
    """
    def deco(fn: F) -> F:
        for cls in inputs:
            if cls.program in PROGRAMS:
                raise ValueError(f"stage program {cls.program!r} is already registered")
            PROGRAMS[cls.program] = fn
        return fn

    return deco


STAGE_INPUTS: tuple[type[StageInput], ...] = (
    PromptsInput, RolloutInput, RolloutMergeInput, ActorLogprobsInput, RefLogprobsInput, RewardsInput, AdvantagesInput,
    CriticValuesInput, CriticUpdateInput, PPOUpdateInput, OptimizerStateInput, PolicyCheckpointInput, DynamicMergeInput,
    EvalPromptsInput,
    EvalGenerateInput, EvalSummaryInput, TeacherLogprobsInput)
