"""The pipeline's padded view of a rollout: its stage column groups joined on ``sample_id`` (in
rollout order) and padded into (B, T) tensors, under the shard column names.

This is what stage programs compute on (the advantage stage, the update's data); the
LightRFT-compatible ``Experience`` / ``BufferItem`` / ``Samples`` records in
``schemas.experience`` are built from it in one place (``to_experience``) and keep the seed's
field names (``action_log_probs`` = old_logprobs, ``base_action_log_probs`` = ref_logprobs).

Layout: prompts left-padded to (B, P), responses right-padded to (B, T) with T >= 1, so the
responses of every row start at column P of ``[prompt | response]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from schemas.columns import PER_TOKEN_COLUMNS
from schemas.shards import ShardSchemaError


def zero_pad_sequences(sequences: list[torch.Tensor], side: str = "left", value: int | float = 0,
                       min_length: int = 0) -> torch.Tensor:
    """Pad 1-D tensors to the longest one (at least ``min_length``) and stack them to (B, L).

    >>> zero_pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], side="left")
    tensor([[1, 2, 3],
            [0, 4, 5]])

    Raises:
        ValueError: ``side`` is not "left" or "right", or the list is empty.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if len(sequences) == 0:
        raise ValueError("zero_pad_sequences needs at least one sequence")
    max_len = max(max(int(s.shape[-1]) for s in sequences), min_length)
    out = []
    for s in sequences:
        pad = max_len - int(s.shape[-1])
        out.append(torch.nn.functional.pad(s, (pad, 0) if side == "left" else (0, pad), value=value))
    return torch.stack(out, dim=0)


def align_on_sample_id(base: pa.Table, other: pa.Table, *, name: str) -> pa.Table:
    """Reorder ``other`` to ``base``'s ``sample_id`` order (list columns are not joinable in Arrow).

    Raises:
        ShardSchemaError: duplicate, missing or extra sample_ids, named with the stage ``name``.
    """
    ids = other.column("sample_id").to_pylist()
    index = {s: i for i, s in enumerate(ids)}
    if len(index) != len(ids):
        raise ShardSchemaError(f"{name}: duplicate sample_id values")
    want = base.column("sample_id").to_pylist()
    missing = [s for s in want if s not in index]
    if missing or len(ids) != len(want):
        raise ShardSchemaError(f"{name}: sample_ids do not match the rollout (missing {missing[:3]}, {len(ids)} vs {len(want)} rows)")
    return other.take(pa.array([index[s] for s in want], pa.int64()))


def check_token_lengths(table: pa.Table, *, name: str, lengths: np.ndarray) -> None:
    """Every per-token list column of ``table`` has one entry per response token.

    Raises:
        ShardSchemaError: naming the column and the first bad sample_id.
    """
    for col in table.column_names:
        if col in PER_TOKEN_COLUMNS:
            got = pc.list_value_length(table.column(col)).to_numpy(zero_copy_only=False)
            bad = np.nonzero(got != lengths)[0]
            if len(bad):
                sid = table.column("sample_id")[int(bad[0])].as_py()
                raise ShardSchemaError(f"{name}: column {col!r} of sample {sid} has {got[bad[0]]} entries, response has {lengths[bad[0]]} tokens")


def pad_lists(col: pa.ChunkedArray | pa.Array, dtype: torch.dtype, side: str = "right") -> torch.Tensor:
    """A list column as a (B, L) tensor, padded with 0 on ``side`` (L >= 1)."""
    rows = col.to_pylist()
    return zero_pad_sequences([torch.tensor(r, dtype=dtype) for r in rows], side, min_length=1)


@dataclass
class ColumnBatch:
    """A rollout's column groups joined on ``sample_id`` and padded (see the module docstring).

    Attributes (B samples, P longest prompt, T longest response, at least 1):
        sample_id, prompt_id, finish_reason: B strings each.
        prompt_token_ids: (B, P) int64, left-padded with ``pad_token_id``; prompt_mask (B, P) int64.
        response_token_ids: (B, T) int64, right-padded; response_mask (B, T) int64, 1 on real tokens.
        action_mask: (B, T) bool, the rollout's ``action_mask`` (tokens that count for the loss).
        response_length: (B,) int64.
        rollout_logprobs: (B, T) float32, the rollout engine's log-probs.
        old_logprobs: (B, T) float32, the actor stage's (the rollout engine's without one).
        ref_logprobs, values, action_entropy, advantages, returns, kl: (B, T) float32 or None
            when their stage is not given.
        sum_pi_squared: (B, T) float32, the actor stage's sum_v pi_old(v)^2 at each token, or
            None when its shard does not carry that optional column (or is not given).
        teacher_logprobs: (B, T) float32, the teacher stage's log nu(y_t) of each response token
            (on-policy distillation), or None when that stage is not given.
        rewards, shaped_rewards: (B,) float32 or None.
    """

    sample_id: list[str]
    prompt_id: list[str]
    finish_reason: list[str]
    prompt_token_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_token_ids: torch.Tensor
    response_mask: torch.Tensor
    action_mask: torch.Tensor
    response_length: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    action_entropy: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    shaped_rewards: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None


def join_column_groups(
    rollout: pa.Table,
    *,
    actor_logprobs: pa.Table | None = None,
    ref_logprobs: pa.Table | None = None,
    rewards: pa.Table | None = None,
    advantages: pa.Table | None = None,
    critic_values: pa.Table | None = None,
    teacher_logprobs: pa.Table | None = None,
    pad_token_id: int = 0,
) -> ColumnBatch:
    """Join the column groups of the stages given (tables of the stage named by each keyword)
    onto the rollout's rows, check their per-token lengths, and pad them into a ColumnBatch.

    Raises:
        ShardSchemaError: mismatched sample_ids or per-token lengths, naming the stage.
    """
    lengths = pc.list_value_length(rollout.column("response_token_ids")).to_numpy(zero_copy_only=False)
    check_token_lengths(rollout, name="rollout", lengths=lengths)
    groups = {}
    for name, t in (("actor_logprobs", actor_logprobs), ("ref_logprobs", ref_logprobs), ("rewards", rewards),
                    ("advantages", advantages), ("critic_values", critic_values), ("teacher_logprobs", teacher_logprobs)):
        if t is not None:
            t = align_on_sample_id(rollout, t, name=name)
            check_token_lengths(t, name=name, lengths=lengths)
            groups[name] = t
    p_ids = pad_lists(rollout.column("prompt_token_ids"), torch.long, "left")
    p_lengths = pc.list_value_length(rollout.column("prompt_token_ids")).to_pylist()
    p_mask = pad_lists(pa.array([[1] * int(n) for n in p_lengths]), torch.long, "left")
    r_ids = pad_lists(rollout.column("response_token_ids"), torch.long)
    r_real = pad_lists(pa.array([[1] * int(n) for n in lengths]), torch.long)
    if pad_token_id:
        p_ids = torch.where(p_mask.bool(), p_ids, torch.full_like(p_ids, pad_token_id))
        r_ids = torch.where(r_real.bool(), r_ids, torch.full_like(r_ids, pad_token_id))
    rollout_lp = pad_lists(rollout.column("rollout_logprobs"), torch.float32)
    actor = groups.get("actor_logprobs")

    def per_token(stage: str, column: str) -> torch.Tensor | None:
        return pad_lists(groups[stage].column(column), torch.float32) if stage in groups else None

    def per_sample(stage: str, column: str) -> torch.Tensor | None:
        return torch.tensor(groups[stage].column(column).to_numpy(), dtype=torch.float32) if stage in groups else None

    return ColumnBatch(
        sample_id=rollout.column("sample_id").to_pylist(), prompt_id=rollout.column("prompt_id").to_pylist(),
        finish_reason=rollout.column("finish_reason").to_pylist(),
        prompt_token_ids=p_ids, prompt_mask=p_mask, response_token_ids=r_ids, response_mask=r_real,
        action_mask=pad_lists(rollout.column("action_mask"), torch.bool),
        response_length=torch.tensor(lengths, dtype=torch.long),
        rollout_logprobs=rollout_lp,
        old_logprobs=pad_lists(actor.column("old_logprobs"), torch.float32) if actor is not None else rollout_lp,
        ref_logprobs=per_token("ref_logprobs", "ref_logprobs"), values=per_token("critic_values", "values"),
        action_entropy=per_token("actor_logprobs", "action_entropy"), rewards=per_sample("rewards", "rewards"),
        advantages=per_token("advantages", "advantages"), returns=per_token("advantages", "returns"),
        kl=per_token("advantages", "kl"), shaped_rewards=per_sample("advantages", "shaped_rewards"),
        sum_pi_squared=(pad_lists(actor.column("sum_pi_squared"), torch.float32)
                        if actor is not None and "sum_pi_squared" in actor.column_names else None),
        teacher_logprobs=per_token("teacher_logprobs", "teacher_logprobs"),
    )
