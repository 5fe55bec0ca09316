"""What a replay reads from a saved run, and the record it leaves in the new run folder."""
from __future__ import annotations

import json

import fsspec

from rft_core.config import TrainConfig
from schemas import ShardNotCommittedError, ShardRef, stage_uri

REPLAY_RECORD = "_REPLAY.json"


def _ref(uri: str) -> ShardRef | None:
    try:
        return ShardRef.from_manifest(uri)
    except ShardNotCommittedError:
        return None


def replay_sources(source_run_root: str, iteration: int, cfg: TrainConfig) -> dict[str, ShardRef]:
    """Committed upstream shards of ``iteration`` in the source run that ``cfg`` needs.

    Returns:
        {"prompts", "rollout", "rewards"} plus "actor_logprobs", "ref_logprobs",
        "critic_values", "baseline_rollout" and "baseline_rewards" (remax's greedy responses) when
        present.
    Raises:
        ShardNotCommittedError: prompts, rollout or rewards missing.
        ValueError: ``cfg`` needs ref_logprobs (kl_coef > 0), critic values (gae), the greedy
            baseline stages (remax) or the actor stage's old log-probs (entropy filter, rollout
            correction, optimal_token_baseline) that the source run did not compute.
    """
    out: dict[str, ShardRef] = {}
    for stage in ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "critic_values", "baseline_rollout",
                  "baseline_rewards"):
        ref = _ref(stage_uri(source_run_root, iteration, stage))
        if ref is not None:
            out[stage] = ref
    for need in ("prompts", "rollout", "rewards"):
        if need not in out:
            raise ShardNotCommittedError(f"{stage_uri(source_run_root, iteration, need)}: not committed; nothing to replay")
    if cfg.kl.needs_reference and "ref_logprobs" not in out:
        raise ValueError(f"kl.kl_coef > 0 needs ref_logprobs, which {source_run_root} iteration {iteration} does not have")
    if cfg.needs_critic and "critic_values" not in out:
        raise ValueError(f"advantage.estimator={cfg.advantage.estimator} needs critic values, which "
                         f"{source_run_root} iteration {iteration} does not have")
    if cfg.needs_greedy_baseline and not {"baseline_rollout", "baseline_rewards"} <= set(out):
        raise ValueError(f"advantage.estimator={cfg.advantage.estimator} needs the greedy responses of the prompts and "
                         f"their rewards (baseline_rollout, baseline_rewards), which {source_run_root} iteration "
                         f"{iteration} does not have")
    if not cfg.needs_greedy_baseline:
        out.pop("baseline_rollout", None)
        out.pop("baseline_rewards", None)
    needs_actor = [k for k, on in (("update.entropy_top_fraction", cfg.update.entropy_top_fraction is not None),
                                   ("update.rollout_correction", cfg.update.rollout_correction.enabled),
                                   (f"advantage.estimator={cfg.advantage.estimator}", cfg.needs_sum_pi_squared)) if on]
    if needs_actor and "actor_logprobs" not in out:
        raise ValueError(f"{' and '.join(needs_actor)} need(s) the actor stage's old log-probs, which {source_run_root} "
                         f"iteration {iteration} does not have (a replay runs no actor stage; the source run skipped "
                         "it: logprobs.recompute_old_logprobs auto or false)")
    if not cfg.kl.needs_reference:
        out.pop("ref_logprobs", None)
    return out


def write_replay_record(run_root: str, source_run_root: str, cfg: TrainConfig) -> None:
    """``{run_root}/_REPLAY.json``: the source run and the settings of this replay."""
    fs, path = fsspec.core.url_to_fs(f"{run_root.rstrip('/')}/{REPLAY_RECORD}")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, json.dumps({"source_run_root": source_run_root, "config": cfg.model_dump(mode="json")},
                                  indent=1).encode())
