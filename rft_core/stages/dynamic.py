"""Dynamic sampling: keep only groups whose rewards differ, across rollout attempts.

Each attempt has its own committed prompts/rollout/rewards shards (``prompts-try0`` ...);
the merge stage writes the usual ``prompts``, ``rollout`` and ``rewards`` shards holding the
kept groups, so every later stage is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rft_core.stages.common import reuse_or_compute, stage_commit
from rft_core.stages.contracts import DynamicMergeInput, stage_program
from rft_core.stages.rewards import rewards_summary, signal_prompt_ids
from rft_core.stages.rollout import rollout_summary
from schemas import ShardRef, read_manifest, read_shard
from schemas.columns import PROMPTS, REWARDS, ROLLOUT


@dataclass(frozen=True)
class Selection:
    """Which groups to keep: (attempt index, prompt_id) in order, plus the bookkeeping."""

    kept: list[tuple[int, str]]
    dropped_flat: int
    duplicates: int
    shortfall: int
    fallback: bool


def select_groups(attempt_rewards: list[pa.Table], target: int) -> Selection:
    """Keep the first ``target`` groups with reward spread, attempt by attempt; a prompt that
    reappears in a later attempt is skipped. With no group kept at all, fall back to every
    group of attempt 0 (their advantages are zero: nothing to learn, nothing divided by zero).
    """
    kept: list[tuple[int, str]] = []
    used: set[str] = set()
    dropped = dups = 0
    for a, table in enumerate(attempt_rewards):
        signal = set(signal_prompt_ids(table))
        for pid in dict.fromkeys(table.column("prompt_id").to_pylist()):
            if pid in used:
                dups += 1
            elif pid not in signal:
                dropped += 1
            elif len(kept) < target:
                kept.append((a, pid))
                used.add(pid)
    if not kept:
        first = list(dict.fromkeys(attempt_rewards[0].column("prompt_id").to_pylist()))
        return Selection([(0, pid) for pid in first], dropped, dups, target, True)
    return Selection(kept, dropped, dups, max(target - len(kept), 0), False)


def count_signal_groups(attempt_rewards: list[ShardRef]) -> int:
    """Distinct prompt_ids with reward spread over all attempts so far."""
    ids: set[str] = set()
    for ref in attempt_rewards:
        ids |= set(signal_prompt_ids(read_shard(ref, stage="rewards")))
    return len(ids)


def _take(tables: list[pa.Table], kept: list[tuple[int, str]]) -> pa.Table:
    parts = []
    for a, pid in kept:
        t = tables[a]
        parts.append(t.filter(pc.equal(t.column("prompt_id"), pid)))
    return pa.concat_tables(parts)


VERSION_KEYS = ("policy_version", "staleness")


def rollout_versions(summaries: list[dict], uris: list[str]) -> dict[str, int]:
    """``policy_version`` and ``staleness`` of the rollout attempts' manifest summaries
    (``rft_core.stages.rollout.version_summary``), which every attempt of an iteration shares
    (one behaviour policy per iteration); {} when no attempt records them.

    Raises:
        ValueError: two attempts (named by ``uris``) record different values.
    """
    seen = {tuple(s.get(k) for k in VERSION_KEYS): uri for s, uri in zip(summaries, uris)
            if any(k in s for k in VERSION_KEYS)}
    if len(seen) > 1:
        (a, ua), (b, ub) = list(seen.items())[:2]
        raise ValueError(f"dynamic sampling: rollout attempts of one iteration record different (policy_version, "
                         f"staleness): {a} in {ua}, {b} in {ub}")
    return {k: v for k, v in zip(VERSION_KEYS, next(iter(seen), ())) if v is not None}


@stage_program(DynamicMergeInput)
def run_merge(inp: DynamicMergeInput) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Write the kept groups of all (prompts, rollout, rewards) attempts as three shards: the
    iteration's prompts (``inp.out``), rollout (``inp.out_rollout``) and rewards
    (``inp.out_rewards``). Rows are copied whole, so multi-turn rollouts keep their trajectory
    columns; the rollout summary is that of the kept rows (with the multi-turn statistics when
    the attempts were multi-turn: their summaries name an ``environment``) and keeps the
    attempts' ``policy_version`` and ``staleness`` (``rollout_versions``), which the iteration's
    metrics read.

    Raises:
        ValueError: the rollout attempts record different policy versions or staleness.
    """
    attempts, target_groups = inp.attempts, inp.target_groups
    summary_cache: dict = {}

    def selection() -> Selection:
        if "sel" not in summary_cache:
            summary_cache["sel"] = select_groups([read_shard(w, stage="rewards") for _, _, w in attempts], target_groups)
        return summary_cache["sel"]

    def merged(stage: str, schema, index: int, out: str) -> ShardRef:
        commit = stage_commit(inp, uri=out, stage=stage, output=stage)

        def compute() -> ShardRef:
            sel = selection()
            table = _take([read_shard(t[index], stage=stage) for t in attempts], sel.kept)
            summary = {"groups_kept": len(sel.kept), "groups_dropped": sel.dropped_flat, "duplicate_groups": sel.duplicates,
                       "refills": len(attempts) - 1, "shortfall": sel.shortfall, "fallback_unfiltered": sel.fallback}
            tries = [read_manifest(t[index].uri)[0].summary for t in attempts]
            if stage == "rollout":  # the usual rollout summary: lengths of the kept samples, speed of all attempts
                gen = sum(s.get("generated_tokens", 0) for s in tries)
                secs = sum(s.get("seconds", 0.0) for s in tries)
                env = next((s["environment"] for s in tries if "environment" in s), None)  # multi-turn attempts
                summary.update(seconds=secs, generated_tokens=gen, tokens_per_second=gen / max(secs, 1e-9),
                               **({"environment": env} if env is not None else {}),
                               **rollout_summary(table, agent=env is not None),
                               **rollout_versions(tries, [t[index].uri for t in attempts]))
            if stage == "prompts":
                summary.update(seconds=sum(s.get("seconds", 0.0) for s in tries),
                               skipped_overlong=sum(s.get("skipped_overlong", 0) for s in tries))
            if stage == "rewards":  # the usual rewards summary, over the kept samples
                summary.update(seconds=sum(s.get("seconds", 0.0) for s in tries), **rewards_summary(table))
            return commit.write(table, schema=schema, summary=summary,
                                inputs={f"{stage}-try{a}": t[index] for a, t in enumerate(attempts)})

        return reuse_or_compute(commit, compute)

    return (merged("prompts", PROMPTS, 0, inp.out), merged("rollout", ROLLOUT, 1, inp.out_rollout),
            merged("rewards", REWARDS, 2, inp.out_rewards))
