"""The models and how they generate and score tokens: which model (``policy``, ``reference``,
``teacher``), the rollout engine's sampling (``rollout``), the log-prob passes (``logprobs``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rft_core.config._base import _check_token_budget, _Frozen
from rft_core.config.agents import AgentConfig
from rft_core.config.scale import SGLangConfig, VLLMConfig
from rft_core.models.hub import DEFAULT_MODEL


class ModelConfig(_Frozen):
    """Which model to load: the embedded default alias, a local HF folder, or a hub id."""

    path: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "auto"] = Field("float32", description="auto: bfloat16 on a GPU that supports it, else float32")


class TeacherConfig(_Frozen):
    """On-policy distillation (docs/algorithms.md, "On-policy distillation"): a teacher model
    scores the student's own sampled tokens (the ``teacher_logprobs`` stage) and the per-token
    signal d_t = -(log pi_old(y_t) - log nu(y_t)), the negative reverse-KL estimate (Agarwal et al.
    2024, arXiv:2306.13649; Thinking Machines, "On-policy distillation", 2025), goes into the
    advantages. Off while ``path`` is None (the default); every other field then stays unset.

    ``use_task_rewards`` (verl's ``distillation_loss.use_task_rewards``): True adds ``coef`` * d_t
    to the task reward's advantage of every action token; False trains on ``coef`` * d_t alone
    (the task rewards are still scored and reported). The teacher must have the policy's
    tokenizer (refused before the first stage otherwise, naming both)."""

    path: str | None = Field(None, description="the teacher: an HF folder (e.g. a checkpoint's policy/ folder), a hub "
                             "id or the embedded default; None: no distillation")
    dtype: Literal["float32", "bfloat16", "auto"] = Field("float32", description="dtype of the teacher's forward pass")
    temperature: float | None = Field(None, gt=0, description="the teacher's logits are divided by this; None: "
                                      "rollout.temperature, the distribution the student samples from (a student "
                                      "equal to the teacher then gets a zero signal; verl scores the teacher at 1.0)")
    coef: float = Field(1.0, gt=0, description="weight of the distillation advantage coef * d_t (verl's "
                        "distillation_loss_coef)")
    use_task_rewards: bool = Field(True, description="True: coef * d_t is added to the task reward's advantage; False: "
                                   "the advantages are coef * d_t alone (distillation only)")

    @model_validator(mode="after")
    def _check_enabled(self) -> "TeacherConfig":
        # fields that differ from their defaults (a dumped config round-trips: every field is "set" there)
        given = sorted(name for name in self.model_fields_set - {"path"}
                       if getattr(self, name) != type(self).model_fields[name].default)
        if self.path is None and given:
            raise ValueError(f"teacher.{given[0]} is set but teacher.path is not: distillation is off without a teacher; "
                             "set teacher.path (an HF folder, hub id or the embedded default) or remove teacher."
                             f"{given[0]}")
        return self

    @property
    def enabled(self) -> bool:
        """Whether distillation is on (a teacher is set): the ``teacher_logprobs`` stage runs."""
        return self.path is not None


class PartialRolloutConfig(_Frozen):
    """Partial (interruptible) rollouts (``rollout.partial``; docs/algorithms.md, "Partial
    rollouts"): each iteration's rollout generates at most ``chunk_tokens`` new tokens per
    unfinished sequence; the sequences of a group that has not finished are committed in the
    rollout shard (``carry/``) and continued by the next iteration's rollout under its (newer)
    policy, from their tokens (prompt + response so far as the new prompt). A group enters
    training in the iteration its last sample finishes. The schedule counts tokens, never time
    (verl PR #1826's chunked max length, without its wall-clock abort), so runs are reproducible
    and resumable bit for bit. Needs ``rollout.max_staleness`` >= 1 (rules ``partial-*``,
    docs/config.md)."""

    chunk_tokens: int = Field(gt=0, description="new tokens per unfinished sequence per iteration; a sequence of "
                              "rollout.max_new_tokens tokens spans ceil(max_new_tokens / chunk_tokens) rollouts")


class RolloutConfig(_Frozen):
    """Sampling settings of the rollout engine."""

    engine: Literal["hf", "vllm", "sglang"] = Field("hf", description="hf: transformers generate (any device); "
                                                   "vllm / sglang: GPU engines (make install-gpu; docs/scale.md)")
    n_samples_per_prompt: int = Field(4, gt=0, description="group size G")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(128, gt=0)
    batch_size: int = Field(32, gt=0, description="sequences generated at once")
    first_token_temperature: float | None = Field(None, gt=0, description="FIRE sampling (arXiv:2410.21236): temperature of the first token only")
    seed: int = 0
    max_staleness: int = Field(0, ge=0, description="asynchronous RL: the rollout of iteration k uses the policy of "
                               "the update of iteration max(0, k-1-s), so it can run while the updates of k-s..k-1 "
                               "train (0: synchronous). s >= 1 needs the actor pass and the rollout correction "
                               "(decoupled PPO, docs/algorithms.md)")
    vllm: VLLMConfig | None = Field(None, description="engine=vllm settings (None: defaults)")
    sglang: SGLangConfig | None = Field(None, description="engine=sglang settings (None: defaults)")
    agent: AgentConfig | None = Field(None, description="multi-turn rollout with an environment (docs/agents.md); "
                                      "None: one response per sample")
    partial: PartialRolloutConfig | None = Field(None, description="partial rollouts: at most chunk_tokens new tokens "
                                                 "per unfinished sequence per iteration, the rest continued by the next "
                                                 "iteration's rollout under the newer policy (needs max_staleness >= 1); "
                                                 "None: every response is generated whole")

    @model_validator(mode="after")
    def _check_agent(self) -> "RolloutConfig":
        if self.agent is not None and (self.engine != "hf" or self.first_token_temperature is not None):
            raise ValueError("rollout.agent runs on the hf engine without FIRE (rollout.engine=hf, "
                             "rollout.first_token_temperature=null)")
        return self


class UpdateGrouping(_Frozen):
    """How the update groups the samples of a rollout into micro-batches in its first epoch
    (``rft_core.training.loop.epoch_micro_batches``): below float32 the actor and reference
    passes group them the same way, so that their log-probs are computed on the very kernel
    shapes of the update's forward and its first step sees them bit for bit (approx_kl 0 between
    a policy and itself; TrainConfig.logprob_grouping)."""

    train_batch_size: int | None = Field(None, gt=0, description="samples per optimizer step (None: the whole rollout)")
    micro_batch_size: int = Field(gt=0)
    seed: int = 0
    packing: bool = True
    policy_version: int = Field(0, ge=0, description="the policy version the update starts from (iteration - 1): "
                                "with seed it orders the update's micro-batches (rft_core.training.update.update_seeds)")
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="update.max_tokens_per_micro_batch: "
                                                   "micro-batches cut by tokens (None: by micro_batch_size)")


class LogprobConfig(_Frozen):
    """Per-token log-prob computation (actor and reference stages)."""

    micro_batch_size: int = Field(8, gt=0, description="sequences per forward pass")
    recompute_old_logprobs: bool | Literal["auto"] = Field(
        "auto", description="True: an actor stage recomputes the old log-probs; False: the rollout engine's own are "
        "the old log-probs (no actor stage); auto: False where the update is on-policy and the engine scores tokens "
        "as the trainer does (TrainConfig.old_logprobs_blockers), else True"
    )
    packing: bool = Field(True, description="pack each micro-batch into one row without padding (position ids restart "
                          "per sequence; False: padded rows)")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="packed rows of at most this many tokens (prompt + response), balanced by tokens "
        "(rft_core.training.loop.pass_micro_batches), instead of micro_batch_size length-sorted sequences (verl's "
        "log_prob_max_token_len_per_gpu with use_dynamic_bsz; needs packing; below float32 the passes take the update's "
        "rows instead). None: micro_batch_size")
    chunk_size: int | None = Field(None, gt=0, description="positions per float32 (chunk, vocab) slice of the log-prob "
                                   "computation (None: about 64 MiB per slice); changes memory, not the values")

    @model_validator(mode="after")
    def _check_budget(self) -> "LogprobConfig":
        _check_token_budget("logprobs", self.max_tokens_per_micro_batch, self.packing)
        return self
