"""The LightRFT-compatible view: Experience batches (padded tensors) <-> per-sample items <->
shard column groups.

The pipeline itself computes on ``schemas.batch.ColumnBatch`` under the shard column names;
this module keeps the seed's record names for users and code written against LightRFT, and
converts in one place (``to_experience``). Names and behaviour follow LightRFT's
``Experience`` / ``BufferItem`` / ``Samples`` and its replay-buffer helpers, with one
documented difference: per-token fields of a BufferItem
(``values``, ``returns``, ``advantages``) have shape (A), one value per action, as they are
actually used, not (1).

Layout of a batch: ``sequences`` is (B, S) = [left-padded prompt | right-padded response]
with the responses in the last A columns; per-action tensors are (B, A), right-padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import torch

from schemas.batch import (  # noqa: F401 - part of this module's surface since before schemas.batch
    ColumnBatch,
    align_on_sample_id,
    check_token_lengths,
    join_column_groups,
    zero_pad_sequences,
)
from schemas.columns import (
    ACTOR_LOGPROBS,
    ADVANTAGES,
    CRITIC_VALUES,
    REF_LOGPROBS,
    REWARDS,
    ROLLOUT,
    TRAJECTORY_COLUMNS,
    policy_version_column,
    single_turn_columns,
)
from schemas.shards import ShardSchemaError


@dataclass
class BufferItem:
    """One sample of experience, unbatched.

    Shapes: sequences (S), attention_mask (S), action_log_probs (A), base_action_log_probs (A),
    values (A), returns (A), advantages (A), action_mask (A), action_entropy (A) or None.
    ``info`` holds per-sample scalars and ids (reward, response_length, sample_id, ...).
    """

    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    base_action_log_probs: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor
    attention_mask: torch.Tensor | None
    action_mask: torch.Tensor | None
    info: dict | None
    action_entropy: torch.Tensor | None = None


@dataclass
class Experience:
    """A batch of experience: padded tensors, left-padded sequences.

    Shapes: sequences (B, S); attention_mask (B, S) long; action_mask (B, A) bool;
    action_log_probs, base_action_log_probs, values, returns, advantages, kl, action_entropy
    (B, A) float32 (optional ones may be None). ``info`` maps names to (B,) tensors or lists.
    """

    sequences: torch.Tensor
    action_log_probs: torch.Tensor
    base_action_log_probs: torch.Tensor | None
    values: torch.Tensor | None
    returns: torch.Tensor | None
    advantages: torch.Tensor | None
    attention_mask: torch.Tensor | None
    action_mask: torch.Tensor | None
    info: dict = field(default_factory=dict)
    kl: torch.Tensor | None = None
    action_entropy: torch.Tensor | None = None


@dataclass
class Samples:
    """Generated sequences before scoring (batched layout).

    Shapes: sequences (B, S), attention_mask (B, S), action_mask (B, A), num_actions int (A),
    response_length (B,), total_length (B,); prompts and labels are lists of B strings.
    ``packed_seq_lens`` and ``pad_len`` are for the packed layout (None here).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor | None
    action_mask: torch.Tensor | None
    num_actions: int | torch.Tensor
    packed_seq_lens: torch.Tensor | None
    response_length: torch.Tensor
    total_length: torch.Tensor
    prompts: list[str]
    labels: list[str]
    pad_len: int | None = None


_ACTION_KEYS = ("action_log_probs", "base_action_log_probs", "values", "returns", "advantages", "action_mask", "action_entropy")


def split_experience_batch(experience: Experience) -> list[BufferItem]:
    """Split a batch into B BufferItems (still padded; see ``remove_padding_in_sequences``).

    ``info`` entries are indexed per sample; ``kl`` is not carried (BufferItem has no kl).
    """
    B = experience.sequences.shape[0]
    items = []
    for i in range(B):
        kw: dict[str, Any] = {"sequences": experience.sequences[i]}
        kw["attention_mask"] = None if experience.attention_mask is None else experience.attention_mask[i]
        for key in _ACTION_KEYS:
            v = getattr(experience, key)
            kw[key] = None if v is None else v[i]
        kw["info"] = {k: v[i] for k, v in experience.info.items()}
        items.append(BufferItem(**kw))
    return items


def make_experience_batch(items: list[BufferItem], packing_samples: bool = False) -> Experience:
    """Batch BufferItems: sequences/attention_mask left-padded, per-action tensors right-padded.

    Raises:
        ValueError: ``items`` is empty.
        NotImplementedError: ``packing_samples=True`` (the packed layout is not built yet).
    """
    if not items:
        raise ValueError("make_experience_batch needs at least one item")
    if packing_samples:
        raise NotImplementedError("packing_samples=True is not implemented; use the padded layout")
    kw: dict[str, Any] = {"sequences": zero_pad_sequences([it.sequences for it in items], "left")}
    kw["attention_mask"] = (None if items[0].attention_mask is None
                            else zero_pad_sequences([it.attention_mask for it in items], "left"))
    for key in _ACTION_KEYS:
        vals = [getattr(it, key) for it in items]
        kw[key] = None if any(v is None for v in vals) else zero_pad_sequences(vals, "right")
    info: dict[str, Any] = {}
    for k in (items[0].info or {}):
        vals = [(it.info or {})[k] for it in items]
        info[k] = torch.stack(vals) if isinstance(vals[0], torch.Tensor) else list(vals)
    kw["info"] = info
    return Experience(**kw)


def remove_padding_in_sequences(items: list[BufferItem]) -> list[BufferItem]:
    """Strip padding from padded BufferItems.

    Left padding is the run of zeros at the start of ``attention_mask``; right padding is the
    run of zeros at its end, or without an attention mask the run of False entries at the end
    of ``action_mask`` (a multi-turn response has False entries inside it too: its observation
    tokens, which are kept). Without masks, leading/trailing zero tokens of ``sequences`` are
    the padding: ``[0, 0, 1, 2, 3, 0, 0] -> [1, 2, 3]``.
    """
    out = []
    for it in items:
        seq = it.sequences
        if it.attention_mask is not None:
            left = int(it.attention_mask.long().argmax())
        else:
            nz = torch.nonzero(seq).flatten()
            left = int(nz[0]) if len(nz) else len(seq)
        if it.attention_mask is not None:
            right = _trailing(it.attention_mask.bool())
        elif it.action_mask is not None:
            right = _trailing(it.action_mask.bool())
        else:
            nz = torch.nonzero(seq).flatten()
            right = len(seq) - 1 - int(nz[-1]) if len(nz) else 0
        end = len(seq) - right
        new = {"sequences": seq[left:end],
               "attention_mask": None if it.attention_mask is None else it.attention_mask[left:end]}
        for key in _ACTION_KEYS:
            v = getattr(it, key)
            new[key] = None if v is None else v[: v.shape[0] - right]
        out.append(replace(it, **new))
    return out


def _trailing(mask: torch.Tensor) -> int:
    """The number of False entries after the last True of a 1-D bool mask (all of it if none)."""
    nz = torch.nonzero(mask).flatten()
    return len(mask) - 1 - int(nz[-1]) if len(nz) else len(mask)


def to_experience(batch: ColumnBatch) -> Experience:
    """The LightRFT ``Experience`` of a ``ColumnBatch``: the one place where the shard column
    names become the seed's field names (old_logprobs -> action_log_probs, ref_logprobs ->
    base_action_log_probs; sequences = [prompt | response], attention_mask likewise). ``info``
    holds sample_id, prompt_id (lists), response_length (B,) int64 and, when joined, rewards /
    shaped_rewards (B,) float32."""
    info: dict[str, Any] = {"sample_id": batch.sample_id, "prompt_id": batch.prompt_id,
                            "response_length": batch.response_length}
    if batch.rewards is not None:
        info["rewards"] = batch.rewards
    if batch.shaped_rewards is not None:
        info["shaped_rewards"] = batch.shaped_rewards
    return Experience(
        sequences=torch.cat([batch.prompt_token_ids, batch.response_token_ids], dim=1),
        action_log_probs=batch.old_logprobs, base_action_log_probs=batch.ref_logprobs, values=batch.values,
        returns=batch.returns, advantages=batch.advantages,
        attention_mask=torch.cat([batch.prompt_mask, batch.response_mask], dim=1),
        action_mask=batch.action_mask, info=info, kl=batch.kl, action_entropy=batch.action_entropy)


def experience_from_tables(
    rollout: pa.Table,
    *,
    actor: pa.Table | None = None,
    ref: pa.Table | None = None,
    rewards: pa.Table | None = None,
    advantages: pa.Table | None = None,
    critic: pa.Table | None = None,
    pad_token_id: int = 0,
) -> Experience:
    """Join stage column groups on ``sample_id`` (rollout order) into an ``Experience``
    (``join_column_groups`` then ``to_experience``). ``action_log_probs`` come from
    ``actor.old_logprobs`` when given, else from the rollout engine's ``rollout_logprobs``.

    Raises:
        ShardSchemaError: mismatched sample_ids or per-token lengths, naming the stage.
    """
    return to_experience(join_column_groups(rollout, actor_logprobs=actor, ref_logprobs=ref, rewards=rewards,
                                            advantages=advantages, critic_values=critic, pad_token_id=pad_token_id))


def samples_from_tables(rollout: pa.Table, prompts: pa.Table | None = None, *, pad_token_id: int = 0) -> Samples:
    """A ``Samples`` batch (batched layout) from a rollout shard table.

    ``prompts`` (the prompts stage table) supplies the prompt texts and labels (answers) per
    sample through ``prompt_id``; without it both lists hold empty strings.

    Raises:
        ShardSchemaError: a rollout prompt_id missing from ``prompts``.
    """
    batch = join_column_groups(rollout, pad_token_id=pad_token_id)
    B, A = batch.action_mask.shape
    pids = rollout.column("prompt_id").to_pylist()
    texts, labels = [""] * B, [""] * B
    if prompts is not None:
        by_id = {r["prompt_id"]: r for r in prompts.select(["prompt_id", "prompt_text", "answer"]).to_pylist()}
        missing = sorted({p for p in pids if p not in by_id})
        if missing:
            raise ShardSchemaError(f"prompts: no row for prompt_id(s) {missing[:3]} of the rollout")
        texts = [by_id[p]["prompt_text"] for p in pids]
        labels = [by_id[p]["answer"] for p in pids]
    attention_mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    return Samples(
        sequences=torch.cat([batch.prompt_token_ids, batch.response_token_ids], dim=1), attention_mask=attention_mask,
        action_mask=batch.action_mask, num_actions=A, packed_seq_lens=None, response_length=batch.response_length,
        total_length=attention_mask.sum(-1), prompts=texts, labels=labels, pad_len=None,
    )


def experience_to_tables(exp: Experience) -> dict[str, pa.Table]:
    """Split an Experience back into the column groups of the rollout and later stages.

    Inverse of ``experience_from_tables`` for the columns an Experience carries. ``info`` must
    hold ``sample_id`` and ``prompt_id``; optional ``response_text``, ``finish_reason``,
    ``rewards``, ``shaped_rewards``, ``images`` / ``videos`` (B lists of encoded bytes, the
    rollout's media columns; [] per sample without them) and the multi-turn columns
    ``num_turns``, ``tool_calls``, ``env_reward``, ``env_fallback``, ``env_error``,
    ``transcript`` (B values each; without them the rows are single-turn:
    ``schemas.columns.single_turn_columns``) are used when present.

    Raises:
        ValueError: ``exp`` has no action_mask or attention_mask.
    """
    if exp.action_mask is None or exp.attention_mask is None:
        raise ValueError("experience_to_tables needs an Experience with action_mask and attention_mask")
    B, A = exp.action_mask.shape
    S = exp.sequences.shape[1]
    P = S - A
    real = exp.attention_mask.bool()
    prompt_ids = [exp.sequences[i, :P][real[i, :P]].tolist() for i in range(B)]
    resp_real = real[:, P:]
    def per_tok(t: torch.Tensor) -> list[list]:
        return [t[i][resp_real[i]].tolist() for i in range(B)]
    sid, pid = list(exp.info["sample_id"]), list(exp.info["prompt_id"])
    text = list(exp.info.get("response_text", [""] * B))
    finish = list(exp.info.get("finish_reason", ["stop"] * B))
    f32 = pa.list_(pa.float32())
    single = single_turn_columns(text)
    turns = {c: [v.item() if isinstance(v, torch.Tensor) else v for v in exp.info.get(c, single[c])]
             for c in TRAJECTORY_COLUMNS}
    out = {"rollout": pa.table({
        "sample_id": sid, "prompt_id": pid,
        "sample_index": pa.array([int(s.rsplit("#", 1)[-1]) if "#" in s else 0 for s in sid], pa.int32()),
        "prompt_token_ids": pa.array(prompt_ids, pa.list_(pa.int32())),
        "response_token_ids": pa.array(per_tok(exp.sequences[:, P:]), pa.list_(pa.int32())),
        "response_text": text,
        "rollout_logprobs": pa.array(per_tok(exp.action_log_probs), f32),
        "action_mask": pa.array(per_tok(exp.action_mask), pa.list_(pa.bool_())),
        "finish_reason": finish,
        "images": [list(m) for m in exp.info.get("images", [[] for _ in range(B)])],
        "videos": [list(m) for m in exp.info.get("videos", [[] for _ in range(B)])],
        **turns,
        **policy_version_column(B, exp.info.get("policy_version")),
    }, schema=ROLLOUT.arrow)}
    entropy = exp.action_entropy if exp.action_entropy is not None else torch.zeros_like(exp.action_log_probs)
    out["actor_logprobs"] = pa.table({"sample_id": sid, "old_logprobs": pa.array(per_tok(exp.action_log_probs), f32),
                                      "action_entropy": pa.array(per_tok(entropy), f32)}, schema=ACTOR_LOGPROBS.arrow)
    if exp.base_action_log_probs is not None:
        out["ref_logprobs"] = pa.table({"sample_id": sid, "ref_logprobs": pa.array(per_tok(exp.base_action_log_probs), f32)}, schema=REF_LOGPROBS.arrow)
    if exp.values is not None:
        out["critic_values"] = pa.table({"sample_id": sid, "values": pa.array(per_tok(exp.values), f32)}, schema=CRITIC_VALUES.arrow)
    if "rewards" in exp.info:
        r = exp.info["rewards"].tolist()
        out["rewards"] = pa.table({
            "sample_id": sid, "prompt_id": pid, "rewards": pa.array(r, pa.float32()),
            "correct": [x >= 1.0 for x in r], "extracted_answer": pa.array([None] * B, pa.string()),
            "reward_metrics": pa.array([[] for _ in range(B)], pa.map_(pa.string(), pa.float32())),
            "reward_reasons": pa.array([[] for _ in range(B)], pa.map_(pa.string(), pa.string())),
        }, schema=REWARDS.arrow)
    if exp.advantages is not None:
        shaped = exp.info.get("shaped_rewards", exp.info.get("rewards", torch.zeros(B))).tolist()
        kl = exp.kl if exp.kl is not None else torch.zeros_like(exp.advantages)
        out["advantages"] = pa.table({
            "sample_id": sid, "prompt_id": pid, "shaped_rewards": pa.array(shaped, pa.float32()),
            "kl": pa.array(per_tok(kl), f32), "advantages": pa.array(per_tok(exp.advantages), f32),
            "returns": pa.array(per_tok(exp.returns if exp.returns is not None else torch.zeros_like(exp.advantages)), f32),
        }, schema=ADVANTAGES.arrow)
    return out
