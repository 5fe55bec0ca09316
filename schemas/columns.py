"""Versioned Arrow schemas, one column group per stage.

Per-token columns are unpadded ``list<>`` columns with one entry per response token; padding to
(B, T) tensors happens only when loading (``schemas.experience``). Every stage's group is keyed
by ``sample_id`` (rollout and later) or ``prompt_id`` (prompts).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pyarrow as pa


@dataclass(frozen=True)
class StageSchema:
    """An Arrow schema with the stage name and version stamped in its metadata.

    ``optional``: columns a shard of the stage may carry or leave out (written only when a stage
    input asks for them, e.g. ``sum_pi_squared`` of ``actor_logprobs``), after the required ones.
    They are not part of ``schema`` nor of the fingerprint, so adding one leaves every committed
    shard readable under the same version; when present, a reader checks their type and nulls
    as it checks the required columns'.
    """

    stage: str
    version: int
    schema: pa.Schema
    optional: tuple[pa.Field, ...] = field(default=())

    @property
    def arrow(self) -> pa.Schema:
        """The schema with ``stage`` and ``schema_version`` metadata (required columns only)."""
        return self.schema.with_metadata({"stage": self.stage, "schema_version": str(self.version)})

    def arrow_with(self, names: "list[str] | tuple[str, ...]") -> pa.Schema:
        """``arrow`` plus the optional columns among ``names`` (in ``optional``'s order).

        Raises:
            KeyError: a name that is no optional column of the stage.
        """
        known = {f.name for f in self.optional}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise KeyError(f"{unknown} are not optional columns of stage {self.stage!r} (optional: {sorted(known)})")
        extra = [f for f in self.optional if f.name in names]
        return pa.schema([*self.schema, *extra]).with_metadata(self.arrow.metadata)

    @property
    def fingerprint(self) -> str:
        """sha256 (hex, first 16) over the required fields' names, types and nullability, in order."""
        text = ";".join(f"{f.name}:{f.type}:{f.nullable}" for f in self.schema)
        return hashlib.sha256(f"{self.stage}/{self.version}/{text}".encode()).hexdigest()[:16]


_tok = pa.list_(pa.int32())
_f32 = pa.list_(pa.float32())

PROMPTS = StageSchema("prompts", 3, pa.schema([  # 3: videos
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("data_source", pa.string(), nullable=False),
    pa.field("question", pa.string(), nullable=False),
    pa.field("prompt_text", pa.string(), nullable=False),  # chat template applied
    pa.field("prompt_token_ids", _tok, nullable=False),
    pa.field("answer", pa.string(), nullable=False),  # the label the grader checks against
    pa.field("metadata_json", pa.string(), nullable=False),  # grader's entry metadata, JSON
    pa.field("images", pa.list_(pa.binary()), nullable=False),  # encoded images (PNG/JPEG bytes); [] for text-only
    pa.field("videos", pa.list_(pa.binary()), nullable=False),  # encoded videos (the container file's bytes); [] for none
]))

# One environment step of a multi-turn trajectory (``rft_core.agents.loop.Trajectory.tool_calls``):
# the model turn it answered (1-based), the tool the environment parsed (null: no call parsed),
# its arguments as JSON text ("" when no call was parsed), the observation shown (null: none),
# the tool's or environment's error (null: none) and the step's wall time in seconds.
TOOL_CALL = pa.struct([
    pa.field("turn", pa.int32(), nullable=False),
    pa.field("name", pa.string(), nullable=True),
    pa.field("arguments", pa.string(), nullable=False),
    pa.field("observation", pa.string(), nullable=True),
    pa.field("error", pa.string(), nullable=True),
    pa.field("seconds", pa.float64(), nullable=False),
])

# 3: videos; 4: multi-turn trajectories (issue 20); 5: policy_version (asynchronous RL, issue 28)
ROLLOUT = StageSchema("rollout", 5, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),  # 0..G-1 inside the group
    pa.field("prompt_token_ids", _tok, nullable=False),
    pa.field("response_token_ids", _tok, nullable=False),
    pa.field("response_text", pa.string(), nullable=False),
    pa.field("rollout_logprobs", _f32, nullable=False),  # engine's log-probs of the sampled tokens (0 on observations)
    pa.field("action_mask", pa.list_(pa.bool_()), nullable=False),  # True on tokens the model sampled
    # "stop" (EOS, or the environment ended it), "length"; multi-turn also "max_turns", "env_error"; a partial
    # rollout's carried sequence (its carry/ table only) "partial": its chunk's token budget was reached
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("images", pa.list_(pa.binary()), nullable=False),  # the prompt's encoded images; [] for text-only
    pa.field("videos", pa.list_(pa.binary()), nullable=False),  # the prompt's encoded videos; [] for none
    # multi-turn (rollout.agent; docs/agents.md). Single-turn rows: 1, [], 0.0, False, null, response_text
    pa.field("num_turns", pa.int32(), nullable=False),  # model turns
    pa.field("tool_calls", pa.list_(TOOL_CALL), nullable=False),  # one per environment step with a call/observation/error
    pa.field("env_reward", pa.float32(), nullable=False),  # sum of the environment's step rewards
    pa.field("env_fallback", pa.bool_(), nullable=False),  # env_reward is rollout.agent.fallback_reward (env failed)
    pa.field("env_error", pa.string(), nullable=True),  # the environment's failure (fallback mode)
    pa.field("transcript", pa.string(), nullable=False),  # the whole response decoded with special tokens
    # the policy that generated the row: the update of that iteration (0: the initial policy; a partial
    # rollout's row: the newest version among its token_versions); null: not a training rollout (evaluation)
    pa.field("policy_version", pa.int32(), nullable=True),
]), optional=(
    # partial rollouts (rollout.partial, issue 48): the policy version that sampled each response token
    # (AReaL's ModelResponse.output_versions); written by a partial rollout only. Without it every token's
    # version is the row's policy_version (token_versions_of)
    pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
))

# The multi-turn columns of ROLLOUT, in order.
TRAJECTORY_COLUMNS = ("num_turns", "tool_calls", "env_reward", "env_fallback", "env_error", "transcript")


def policy_version_column(n: int, version: int | None) -> dict[str, list]:
    """The ``policy_version`` column of ``n`` rollout rows generated by policy ``version``
    (the update of that iteration; 0: the initial policy; None: not a training rollout)."""
    return {"policy_version": [version] * n}


def token_versions_of(table: pa.Table) -> list[list[int]]:
    """The policy version of every response token of a rollout table, one list per row (int): the
    ``token_versions`` column where a partial rollout wrote it, else each row's ``policy_version``
    repeated over its response (a null version, a non-training rollout, reads as -1).

    Raises:
        KeyError: the table has neither column.
    """
    if "token_versions" in table.column_names:
        return table.column("token_versions").to_pylist()
    lengths = [len(r) for r in table.column("response_token_ids").to_pylist()]
    versions = table.column("policy_version").to_pylist()
    return [[-1 if v is None else v] * n for v, n in zip(versions, lengths)]


def single_turn_columns(response_texts: list[str]) -> dict[str, list]:
    """The multi-turn columns (``TRAJECTORY_COLUMNS``) of single-turn rollout rows: one turn,
    no tool calls, no environment reward, not a fallback, no error, the transcript is the
    response text. For the writers of single-turn rollout tables (the rollout and eval stages,
    ``schemas.experience.experience_to_tables``, test fixtures)."""
    n = len(response_texts)
    return {"num_turns": [1] * n, "tool_calls": [[] for _ in range(n)], "env_reward": [0.0] * n,
            "env_fallback": [False] * n, "env_error": [None] * n, "transcript": list(response_texts)}

ACTOR_LOGPROBS = StageSchema("actor_logprobs", 1, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("old_logprobs", _f32, nullable=False),
    pa.field("action_entropy", _f32, nullable=False),  # entropy (nats) of the policy at each token
]), optional=(
    # sum_v pi_old(v)^2 at each token (pi_old = softmax(logits / temperature)), written only when
    # ActorLogprobsInput.with_sum_pi_squared (the optimal token baseline's input)
    pa.field("sum_pi_squared", _f32, nullable=False),
))

REF_LOGPROBS = StageSchema("ref_logprobs", 1, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("ref_logprobs", _f32, nullable=False),
]))

# On-policy distillation (TrainConfig.teacher): log nu(y_t) of every response token under the teacher
TEACHER_LOGPROBS = StageSchema("teacher_logprobs", 1, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("teacher_logprobs", _f32, nullable=False),
]))

CRITIC_VALUES = StageSchema("critic_values", 1, pa.schema([  # PPO with a critic (GAE)
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("values", _f32, nullable=False),
]))

# One LLM judge's verdict on a sample (``rft_core.rewards.judge``): the reward source, the judge model asked, the
# endpoint that answered, the template hash and sample hash of its cache key, the system message (null: none) and
# the user message sent, the raw reply ("" when the request failed), the model the endpoint says answered, the
# reply's finish reason, the score parsed from the reply before any fallback (null: none), the request's error
# (null: a reply came)
JUDGE_VERDICT = pa.struct([
    pa.field("source", pa.string(), nullable=False),
    pa.field("judge_model", pa.string(), nullable=False),
    pa.field("endpoint", pa.string(), nullable=False),
    pa.field("template_hash", pa.string(), nullable=False),
    pa.field("sample_hash", pa.string(), nullable=False),
    pa.field("system", pa.string(), nullable=True),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("reply", pa.string(), nullable=False),
    pa.field("served_model", pa.string(), nullable=True),
    pa.field("finish_reason", pa.string(), nullable=True),
    pa.field("score", pa.float64(), nullable=True),
    pa.field("error", pa.string(), nullable=True),
])

REWARDS = StageSchema("rewards", 2, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("rewards", pa.float32(), nullable=False),
    pa.field("correct", pa.bool_(), nullable=False),
    pa.field("extracted_answer", pa.string(), nullable=True),
    pa.field("reward_metrics", pa.map_(pa.string(), pa.float32()), nullable=False),  # per-source score (+ counters)
    pa.field("reward_reasons", pa.map_(pa.string(), pa.string()), nullable=False),  # per-source why, when not plain
]), optional=(
    # the verdicts of the sample's LLM judges (one per llm_judge source of its recipe; [] for a recipe without
    # one), written when a recipe of the reward config uses an llm_judge source
    pa.field("judge_verdicts", pa.list_(JUDGE_VERDICT), nullable=False),
))

ADVANTAGES = StageSchema("advantages", 1, pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("shaped_rewards", pa.float32(), nullable=False),  # reward after the KL penalty
    pa.field("kl", _f32, nullable=False),  # per-token KL estimate vs the reference
    pa.field("advantages", _f32, nullable=False),
    pa.field("returns", _f32, nullable=False),
]))

PPO_UPDATE = StageSchema("ppo_update", 1, pa.schema([
    pa.field("step", pa.int32(), nullable=False),  # optimizer step inside this update
    pa.field("epoch", pa.int32(), nullable=False),
    pa.field("policy_loss", pa.float32(), nullable=False),
    pa.field("kl_loss", pa.float32(), nullable=False),
    pa.field("clip_frac", pa.float32(), nullable=False),
    pa.field("approx_kl", pa.float32(), nullable=False),
    pa.field("grad_norm", pa.float32(), nullable=False),
    pa.field("lr", pa.float32(), nullable=False),
    pa.field("num_tokens", pa.int64(), nullable=False),
]))

CRITIC_UPDATE = StageSchema("critic_update", 1, pa.schema([
    pa.field("step", pa.int32(), nullable=False),
    pa.field("epoch", pa.int32(), nullable=False),
    pa.field("value_loss", pa.float32(), nullable=False),
    pa.field("value_clip_frac", pa.float32(), nullable=False),
    pa.field("grad_norm", pa.float32(), nullable=False),
    pa.field("lr", pa.float32(), nullable=False),
    pa.field("num_tokens", pa.int64(), nullable=False),
]))

EVAL = StageSchema("eval", 1, pa.schema([  # held-out evaluation (flows/eval.py): one greedy response per prompt
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("question", pa.string(), nullable=False),
    pa.field("answer", pa.string(), nullable=False),  # the label
    pa.field("response_text", pa.string(), nullable=False),
    pa.field("extracted_answer", pa.string(), nullable=True),
    pa.field("rewards", pa.float32(), nullable=False),
    pa.field("correct", pa.bool_(), nullable=False),
    pa.field("response_length", pa.int32(), nullable=False),  # response tokens
    pa.field("finish_reason", pa.string(), nullable=False),
]), optional=(
    # written by a sampled evaluation (eval.n_samples / eval.temperature): the prompt's label and
    # the response's index among its prompt's n; a greedy eval shard has neither (as before)
    pa.field("data_source", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
))

# The policy's AdamW state (rft_core.stages.optimizer_state): one checkpoint file, optimizer.pt,
# and no rows; the manifest's summary says how it was written (seconds, recovered).
OPTIMIZER_STATE = StageSchema("optimizer_state", 1, pa.schema([]))
# the policy's weights of a resident checkpoint iteration, written after its ppo_update (rft_core.stages.optimizer_state)
POLICY_CHECKPOINT = StageSchema("policy_checkpoint", 1, pa.schema([]))

STAGE_SCHEMAS: dict[str, StageSchema] = {
    s.stage: s for s in (PROMPTS, ROLLOUT, ACTOR_LOGPROBS, REF_LOGPROBS, CRITIC_VALUES, REWARDS, ADVANTAGES, PPO_UPDATE,
                         CRITIC_UPDATE, EVAL, OPTIMIZER_STATE, POLICY_CHECKPOINT, TEACHER_LOGPROBS)
}

# Per-token list columns that must have one entry per response token.
PER_TOKEN_COLUMNS = {"rollout_logprobs", "action_mask", "token_versions", "old_logprobs", "action_entropy", "sum_pi_squared", "ref_logprobs",
                     "values", "kl", "advantages", "returns", "teacher_logprobs"}


def schema_for(stage: str) -> StageSchema:
    """The schema of ``stage``.

    Raises:
        KeyError: unknown stage; the message lists the known ones.
    """
    try:
        return STAGE_SCHEMAS[stage]
    except KeyError:
        raise KeyError(f"no schema for stage {stage!r}; known stages: {', '.join(sorted(STAGE_SCHEMAS))}") from None
