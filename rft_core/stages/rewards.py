"""Reward stage: score every response of the rollout with the reward engine (sources + recipes)."""
from __future__ import annotations

import json

import pyarrow as pa

from rft_core.rewards.base import RewardSample
from rft_core.rewards.engine import RewardEngine
from rft_core.rewards.user import code_fingerprints
from rft_core.stages.common import Timer, reuse_or_compute, stage_commit
from rft_core.stages.contracts import RewardsInput, stage_program
from schemas import ShardRef, ShardSchemaError, read_manifest, read_shard, split_stage_uri
from schemas.columns import JUDGE_VERDICT, REWARDS


def rewards_summary(table: pa.Table) -> dict[str, float]:
    """Mean reward, accuracy and format rate of a rewards table. The format rate reads the
    ``format`` source's score, else any source's ``<source>.format`` extra (0 when absent). An
    empty table (a partial-rollout iteration in which no group finished) has none of them: {}."""
    if table.num_rows == 0:
        return {}
    n = table.num_rows
    metrics = [dict(m) for m in table.column("reward_metrics").to_pylist()]

    def fmt(m: dict) -> float:
        if "format" in m:
            return float(m["format"])
        return max((float(v) for k, v in m.items() if k.endswith(".format")), default=0.0)

    return {"reward_mean": sum(table.column("rewards").to_pylist()) / n,
            "accuracy": sum(table.column("correct").to_pylist()) / n,
            "format_rate": sum(fmt(m) for m in metrics) / n}


def signal_prompt_ids(table: pa.Table) -> list[str]:
    """prompt_ids (first-seen order) whose samples got more than one distinct reward: the groups
    that give GRPO-style estimators a non-zero advantage."""
    seen: dict[str, set] = {}
    for pid, r in zip(table.column("prompt_id").to_pylist(), table.column("rewards").to_pylist()):
        seen.setdefault(pid, set()).add(r)
    return [pid for pid, vals in seen.items() if len(vals) > 1]


def reward_samples(rollout: pa.Table, prompts: pa.Table, *, rollout_uri: str = "rollout", prompts_uri: str = "prompts",
                   multi_turn: bool = False) -> list[RewardSample]:
    """Join rollout rows with their prompts into ``RewardSample``s (rollout order).

    ``multi_turn``: the rollout is a multi-turn one (its manifest names an ``environment``):
    each sample gets its row's ``env_reward`` and ``env_fallback``; otherwise ``env_reward`` is
    None (there was no environment). ``response`` is the row's ``response_text`` (a
    trajectory's last model turn).

    Raises:
        ShardSchemaError: a rollout sample whose prompt_id is not in the prompts table.
    """
    by_id = {row["prompt_id"]: row for row in prompts.to_pylist()}
    out = []
    cols = [rollout.column(c).to_pylist() for c in ("sample_id", "prompt_id", "response_text", "finish_reason",
                                                   "env_reward", "env_fallback")]
    for sid, pid, text, finish, env_reward, env_fallback in zip(*cols):
        if pid not in by_id:
            raise ShardSchemaError(f"{rollout_uri}: prompt_id {pid!r} is not in {prompts_uri}")
        row = by_id[pid]
        out.append(RewardSample(sample_id=sid, prompt_id=pid, label=row["data_source"], question=row["question"],
                                prompt_text=row["prompt_text"], response=text, reference=row["answer"],
                                metadata=json.loads(row["metadata_json"]), finish_reason=finish,
                                images=list(row.get("images") or []), videos=list(row.get("videos") or []),
                                env_reward=float(env_reward) if multi_turn else None,
                                env_fallback=bool(env_fallback) and multi_turn))
    return out


def verdict_cache_root(out: str) -> str:
    """Where the sources of a rewards stage writing to ``out`` keep state across attempts (the
    llm_judge's verdicts, ``rft_core.rewards.judge.VerdictCache``): the run root of a stage
    folder of the run layout, so that every iteration and every attempt of the run shares it;
    else (an evaluation's ``{root}/rewards``) the folder ``out`` sits in."""
    where = split_stage_uri(out)
    if where is not None:
        return where[0]
    head, sep, _ = out.rstrip("/").rpartition("/")
    return head if sep and not head.endswith(":/") else out


@stage_program(RewardsInput)
def run(inp: RewardsInput) -> ShardRef:
    """Score each sample with the reward engine (``rft_core.rewards.engine``); writes rewards,
    correct, extracted_answer, per-source ``reward_metrics`` and ``reward_reasons``, and with an
    llm_judge source the optional ``judge_verdicts`` (each sample's verdicts; ``rft_core.rewards.judge``:
    stored as they arrive under ``verdict_cache_root``, so an attempt that failed half-way, or a
    rerun, asks the judge only for the samples it has no verdict for).

    Summary: reward_mean, accuracy, format_rate, ``reward_fallbacks`` (scores replaced by a
    source's fallback) and ``reward_sources`` ({source: {n, mean, fallbacks}}; a judge also
    ``judge_requests`` and ``judge_stored``: verdicts asked of it and read from storage).

    Raises:
        ShardSchemaError: a rollout sample whose prompt_id is not in the prompts shard.
        RewardError: a source failed with ``on_error: raise``, or a label has no recipe.
        SourceUnavailableError: a judge's endpoint failed or its key is missing (whatever ``on_error``).
        StaleShardError: a committed shard at ``inp.out`` came from another config, other inputs or
            another version of a user reward function's source file.
    """
    # user functions' source files count as config: editing one makes a committed shard stale
    commit = stage_commit(inp, code=code_fingerprints(inp.reward) or None)
    rollout, prompts = inp.rollout, inp.prompts

    def compute() -> ShardRef:
        samples = reward_samples(read_shard(rollout, stage="rollout"), read_shard(prompts, stage="prompts"),
                                 rollout_uri=rollout.uri, prompts_uri=prompts.uri,
                                 multi_turn="environment" in read_manifest(rollout.uri)[0].summary)
        with Timer() as t:
            batch = RewardEngine(inp.reward, cache_root=verdict_cache_root(inp.out)).score(samples)
        res = batch.results
        columns = {
            "sample_id": [s.sample_id for s in samples], "prompt_id": [s.prompt_id for s in samples],
            "rewards": pa.array([x.reward for x in res], pa.float32()),
            "correct": [x.correct for x in res],
            "extracted_answer": pa.array([x.extracted for x in res], pa.string()),
            "reward_metrics": pa.array([list(x.metrics.items()) for x in res], pa.map_(pa.string(), pa.float32())),
            "reward_reasons": pa.array([list(x.reasons.items()) for x in res], pa.map_(pa.string(), pa.string())),
        }
        optional = []
        if any(src.stores_verdicts for src in inp.reward.used_sources()):
            columns["judge_verdicts"] = pa.array([x.verdicts for x in res], pa.list_(JUDGE_VERDICT))
            optional.append("judge_verdicts")
        table = pa.table(columns, schema=REWARDS.arrow_with(optional))
        summary = {"seconds": t.seconds, **rewards_summary(table), "reward_fallbacks": batch.fallbacks,
                   "reward_sources": batch.source_stats}
        return commit.write(table, schema=REWARDS, inputs={"rollout": rollout, "prompts": prompts}, summary=summary)

    return reuse_or_compute(commit, compute)
