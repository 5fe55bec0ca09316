"""One multi-turn trajectory as text, turn by turn (``rft inspect RUN -i N --sample ID``).

A rollout row holds the whole response as token ids with its ``action_mask`` (True on the
tokens the model sampled) and its ``tool_calls`` records; the model turns are the runs of True,
the observations the runs of False between them. ``render_trajectory`` prints each model turn,
the environment step that answered it (tool, arguments, observation or error, seconds) and the
observation tokens as the model saw them, then the graded final answer and the reward.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from schemas import ShardError, read_shard, stage_uri

__all__ = ["render_trajectory", "sample_text", "segments"]


def segments(action_mask: Sequence[bool]) -> list[tuple[bool, int, int]]:
    """The runs of equal values of ``action_mask``: (is_model, start, end) with end exclusive.

    >>> segments([True, True, False, True])
    [(True, 0, 2), (False, 2, 3), (True, 3, 4)]
    """
    out: list[tuple[bool, int, int]] = []
    for i, m in enumerate(action_mask):
        if out and out[-1][0] == bool(m):
            out[-1] = (out[-1][0], out[-1][1], i + 1)
        else:
            out.append((bool(m), i, i + 1))
    return out


def _call_line(c: Mapping[str, Any]) -> str:
    head = f"  step of turn {c['turn']}: "
    head += f"{c['name']}({c['arguments']})" if c.get("name") is not None else "no tool call parsed"
    tail = []
    if c.get("observation") is not None:
        tail.append(f"observation {json.dumps(c['observation'])}")
    if c.get("error") is not None:
        tail.append(f"error {json.dumps(c['error'])}")
    return head + (" -> " + "; ".join(tail) if tail else "") + f"  [{float(c.get('seconds') or 0.0):.3f} s]"


def render_trajectory(row: Mapping[str, Any], *, tokenizer: Any = None, prompt: Mapping[str, Any] | None = None,
                      reward: Mapping[str, Any] | None = None) -> str:
    """A rollout row (a dict of the ``rollout`` shard's columns) as text, turn by turn.

    Args:
        row: the rollout row (``sample_id``, ``response_token_ids``, ``action_mask``,
            ``tool_calls``, ``num_turns``, ``finish_reason``, ``env_reward``, ``env_fallback``,
            ``env_error``, ``response_text``, ``transcript``).
        tokenizer: the policy's tokenizer: each model turn and observation is decoded from its
            tokens (special tokens kept). None: the ``transcript`` is printed whole instead.
        prompt: the prompts shard's row of the sample (question, answer), optional.
        reward: the rewards shard's row of the sample (rewards, correct, extracted_answer,
            reward_metrics), optional.
    Returns:
        the text (lines joined by newlines, no trailing newline).
    Raises:
        ValueError: a row whose ``action_mask`` and ``response_token_ids`` differ in length.
    """
    ids, mask = list(row["response_token_ids"]), list(row["action_mask"])
    if len(ids) != len(mask):
        raise ValueError(f"sample {row.get('sample_id')}: {len(ids)} response tokens but {len(mask)} action_mask entries")
    calls = list(row.get("tool_calls") or [])
    lines = [f"sample {row['sample_id']} (prompt {row['prompt_id']}): {row.get('num_turns', 1)} model turn(s), "
             f"{sum(mask)} model + {len(mask) - sum(mask)} observation tokens, finish_reason {row['finish_reason']}"]
    if prompt is not None:
        lines += [f"question: {prompt.get('question')}", f"answer (label): {prompt.get('answer')}"]
    if tokenizer is None:
        lines += ["--- transcript (model turns and observations, special tokens kept)", str(row.get("transcript", ""))]
        lines += ["--- environment steps"] + [_call_line(c) for c in calls]
    else:
        turn, shown = 0, set()
        for is_model, a, b in segments(mask):
            text = tokenizer.decode(ids[a:b], skip_special_tokens=False)
            if is_model:
                turn += 1
                lines += [f"--- model turn {turn} ({b - a} tokens)", text]
                for k, c in enumerate(calls):
                    if c["turn"] == turn:
                        lines.append(_call_line(c))
                        shown.add(k)
            else:
                lines += [f"--- observation ({b - a} tokens, not trained on)", text]
        lines += [_call_line(c) for k, c in enumerate(calls) if k not in shown]  # e.g. steps of a reset failure
    lines.append(f"--- final answer (what the reward stage grades): {json.dumps(row.get('response_text', ''))}")
    env = f"env_reward {float(row.get('env_reward') or 0.0):g}" + (" (fallback)" if row.get("env_fallback") else "")
    if row.get("env_error"):
        env += f", env_error {row['env_error']}"
    lines.append(env)
    if reward is not None:
        metrics = dict(reward.get("reward_metrics") or [])
        lines.append(f"reward {float(reward['rewards']):g} ({'correct' if reward.get('correct') else 'not correct'}, "
                     f"extracted {reward.get('extracted_answer')!r}); per source {json.dumps(metrics, sort_keys=True)}")
    return "\n".join(lines)


def sample_text(run_root: str, iteration: int, sample_id: str, *, tokenizer: Any = None) -> str:
    """``render_trajectory`` of sample ``sample_id`` of iteration ``iteration`` of the run at
    ``run_root`` (any fsspec URI), with its prompt and reward rows when those stages are committed.

    ``tokenizer``: the policy's (each turn decoded on its own); None shows the transcript whole.
    ``rft_core.api.sample_transcript`` (``rft inspect --sample``) passes the one saved with the
    iteration's checkpoint.

    Raises:
        ShardError: the iteration's rollout is not committed or unreadable.
        KeyError: no sample ``sample_id`` in the rollout (the message lists a few).
    """
    import pyarrow.compute as pc

    rollout = read_shard(stage_uri(run_root, iteration, "rollout"), stage="rollout")
    hit = rollout.filter(pc.equal(rollout.column("sample_id"), sample_id))
    if hit.num_rows == 0:
        some = rollout.column("sample_id").to_pylist()[:5]
        raise KeyError(f"{stage_uri(run_root, iteration, 'rollout')}: no sample {sample_id!r} (e.g. {', '.join(some)})")
    row = hit.to_pylist()[0]
    extra: dict[str, Any] = {}
    for stage, key, name in (("prompts", "prompt_id", "prompt"), ("rewards", "sample_id", "reward")):
        try:
            t = read_shard(stage_uri(run_root, iteration, stage), stage=stage)
        except ShardError:
            continue
        match = t.filter(pc.equal(t.column(key), row[key])).to_pylist()
        extra[name] = match[0] if match else None
    return render_trajectory(row, tokenizer=tokenizer, **extra)
