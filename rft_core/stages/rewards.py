"""Reward stage: grade every response of the rollout against its prompt's label."""
from __future__ import annotations

import pyarrow as pa

from rft_core.config import RewardConfig
from rft_core.rewards.math import score_response
from rft_core.stages.common import Timer, reuse_or_compute
from schemas import ShardRef, ShardSchemaError, config_hash, read_shard, write_shard
from schemas.columns import REWARDS


def rewards_summary(table: pa.Table) -> dict[str, float]:
    """Mean reward, accuracy and format rate of a rewards table."""
    n = max(table.num_rows, 1)
    metrics = [dict(m) for m in table.column("reward_metrics").to_pylist()]
    return {"reward_mean": sum(table.column("rewards").to_pylist()) / n,
            "accuracy": sum(table.column("correct").to_pylist()) / n,
            "format_rate": sum(m.get("format", 0.0) for m in metrics) / n}


def signal_prompt_ids(table: pa.Table) -> list[str]:
    """prompt_ids (first-seen order) whose samples got more than one distinct reward: the groups
    that give GRPO-style estimators a non-zero advantage."""
    seen: dict[str, set] = {}
    for pid, r in zip(table.column("prompt_id").to_pylist(), table.column("rewards").to_pylist()):
        seen.setdefault(pid, set()).add(r)
    return [pid for pid, vals in seen.items() if len(vals) > 1]


def run(rollout: ShardRef, prompts: ShardRef, cfg: RewardConfig, *, out: str) -> ShardRef:
    """Score each sample; writes rewards, correct, extracted_answer and per-source reward_metrics.

    Raises:
        ShardSchemaError: a rollout sample whose prompt_id is not in the prompts shard.
    """
    chash = config_hash("rewards", cfg, rollout, prompts)

    def compute() -> ShardRef:
        r = read_shard(rollout, stage="rollout")
        p = read_shard(prompts, stage="prompts").to_pylist()
        by_id = {row["prompt_id"]: row for row in p}
        results = []
        with Timer() as t:
            for pid, text in zip(r.column("prompt_id").to_pylist(), r.column("response_text").to_pylist()):
                if pid not in by_id:
                    raise ShardSchemaError(f"{rollout.uri}: prompt_id {pid!r} is not in {prompts.uri}")
                row = by_id[pid]
                results.append(score_response(text, source=row["data_source"], question=row["question"], label=row["answer"],
                                              metadata_json=row["metadata_json"], grader=cfg.grader,
                                              correct_reward=cfg.correct_reward, format_reward=cfg.format_reward))
        table = pa.table({
            "sample_id": r.column("sample_id"), "prompt_id": r.column("prompt_id"),
            "rewards": pa.array([x.reward for x in results], pa.float32()),
            "correct": [x.correct for x in results],
            "extracted_answer": pa.array([x.extracted for x in results], pa.string()),
            "reward_metrics": pa.array([list(x.metrics.items()) for x in results], pa.map_(pa.string(), pa.float32())),
        }, schema=REWARDS.arrow)
        summary = {"seconds": t.seconds, **rewards_summary(table)}
        return write_shard(table, out, schema=REWARDS, config_hash=chash, inputs={"rollout": rollout, "prompts": prompts},
                           summary=summary)

    return reuse_or_compute("rewards", out, chash, compute)
