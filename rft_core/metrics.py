"""Iteration metrics gathered from the stage manifests' summaries (no recomputation)."""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import fsspec

from schemas import ShardRef, read_manifest

# (metric name, stage, summary key)
_FROM_SUMMARY = [
    ("reward_mean", "advantages", "reward_mean"),
    ("reward_std", "advantages", "reward_std"),
    ("accuracy", "rewards", "accuracy"),
    ("format_rate", "rewards", "format_rate"),
    ("reward_fallbacks", "rewards", "reward_fallbacks"),
    ("kl", "advantages", "kl_mean"),
    ("kl_coef", "advantages", "kl_coef"),
    ("next_kl_coef", "advantages", "next_kl_coef"),
    ("groups_with_signal", "advantages", "groups_with_signal"),
    ("shaped_reward_mean", "advantages", "shaped_reward_mean"),
    ("overlong_penalty_mean", "advantages", "overlong_penalty_mean"),
    ("reward_clip_frac", "advantages", "reward_clip_frac"),
    ("advantage_clip_frac", "advantages", "advantage_clip_frac"),
    ("clip_filter_like_weight_mean", "advantages", "clip_filter_like_weight_mean"),
    # remax: the (shaped) reward of the greedy response of each sample's prompt, and its raw accuracy
    ("greedy_baseline_reward_mean", "advantages", "greedy_baseline_reward_mean"),
    ("greedy_accuracy", "baseline_rewards", "accuracy"),
    # on-policy distillation (teacher.path): mean over action tokens of log pi_old - log nu (k1 of the reverse KL)
    ("distill_reverse_kl", "advantages", "distill_reverse_kl"),
    ("response_length", "rollout", "response_length_mean"),
    ("truncated_fraction", "rollout", "truncated_fraction"),
    ("tokens_per_second", "rollout", "tokens_per_second"),
    # asynchronous RL (rollout.max_staleness): the policy that generated the rollout, and how many
    # updates it lags behind the one this iteration's update starts from
    ("policy_version", "rollout", "policy_version"),
    ("staleness", "rollout", "staleness"),
    # partial rollouts (rollout.partial; rft_core.stages.partial.partial_summary): groups that entered
    # training / were carried over, trajectories whose tokens span several versions, the mean run of
    # tokens from one version, and the tokens' own staleness (mean, max)
    ("partial_finished_groups", "rollout", "partial_finished_groups"),
    ("partial_carried_groups", "rollout", "partial_carried_groups"),
    ("multi_version_frac", "rollout", "multi_version_frac"),
    ("version_span_tokens", "rollout", "version_span_tokens_mean"),
    ("token_staleness", "rollout", "token_staleness_mean"),
    ("token_staleness_max", "rollout", "token_staleness_max"),
    # multi-turn rollouts (rollout.agent; rft_core.stages.rollout.rollout_summary): per trajectory
    ("num_turns", "rollout", "num_turns_mean"),
    ("tool_call_rate", "rollout", "tool_call_rate"),
    ("tool_calls", "rollout", "tool_calls_mean"),
    ("tool_error_frac", "rollout", "tool_error_frac"),
    ("model_tokens", "rollout", "model_tokens_mean"),
    ("env_reward", "rollout", "env_reward_mean"),
    ("env_fallback_frac", "rollout", "env_fallback_frac"),
    ("max_turns_fraction", "rollout", "max_turns_fraction"),
    ("entropy", "actor_logprobs", "entropy_mean"),
    ("value_mean", "critic_values", "value_mean"),
    ("value_loss", "critic_update", "value_loss"),
    ("value_clip_frac", "critic_update", "value_clip_frac"),
    ("policy_loss", "ppo_update", "policy_loss"),
    ("clip_frac", "ppo_update", "clip_frac"),
    ("approx_kl", "ppo_update", "approx_kl"),
    ("grad_norm", "ppo_update", "grad_norm"),
    ("kl_loss", "ppo_update", "kl_loss"),
    ("cpgd_drift", "ppo_update", "cpgd_drift"),
    # rollout/trainer mismatch (rft_core.algorithms.correction): rollout_kl whenever the actor stage
    # ran, the importance-weight statistics when update.rollout_correction is on
    ("rollout_kl", "ppo_update", "rollout_kl"),
    # without the actor stage: the engine's log-probs against the policy's own, before the first step
    ("old_logprobs_gap_kl", "ppo_update", "old_logprobs_gap_kl"),
    ("rollout_is_weight_mean", "ppo_update", "rollout_is_weight_mean"),
    ("rollout_is_weight_max", "ppo_update", "rollout_is_weight_max"),
    ("rollout_is_capped_frac", "ppo_update", "rollout_is_capped_frac"),
    ("rollout_is_token_masked_frac", "ppo_update", "rollout_is_token_masked_frac"),
    ("rollout_is_seq_masked_frac", "ppo_update", "rollout_is_seq_masked_frac"),
    ("overlong_filtered_frac", "advantages", "overlong_filtered_frac"),
    ("skipped_overlong", "prompts", "skipped_overlong"),
    ("dynamic_groups_kept", "rewards", "groups_kept"),
    ("dynamic_groups_dropped", "rewards", "groups_dropped"),
    ("dynamic_refills", "rewards", "refills"),
    ("dynamic_shortfall", "rewards", "shortfall"),
]


def iteration_metrics(iteration: int, refs: Mapping[str, ShardRef | None]) -> dict[str, Any]:
    """Metrics of one iteration from its stages' manifests.

    Returns:
        flat dict: iteration, the metrics above, a partial rollout's
        ``rollout_is_weight_mean_staleness_<d>`` (the update's mean correction weight of the
        tokens sampled d updates before its starting policy), and ``seconds/<stage>`` for each
        stage run.
    """
    summaries = {stage: read_manifest(ref.uri)[0].summary for stage, ref in refs.items() if ref is not None}
    out: dict[str, Any] = {"iteration": iteration}
    for name, stage, key in _FROM_SUMMARY:
        if stage in summaries and key in summaries[stage]:
            out[name] = summaries[stage][key]
    for key, value in summaries.get("ppo_update", {}).items():  # a partial rollout's correction by token age
        if key.startswith("rollout_is_weight_mean_staleness_"):
            out[key] = value
    for stage, s in summaries.items():
        if "seconds" in s:
            out[f"seconds/{stage}"] = round(float(s["seconds"]) + float(s.get("checkpoint_seconds", 0.0))
                                            + float(s.get("optimizer_seconds", 0.0)), 3)  # a sharded critic's state
    return out


def format_metrics_line(m: Mapping[str, Any]) -> str:
    """One human-readable line per iteration (the rollout correction's mean weight and capped
    fraction, the overlong-filtered fraction, on-policy distillation's reverse-KL estimate, for a
    multi-turn run the mean number of model turns and the tool-call rate, and for partial rollouts
    the fraction of trajectories spanning several policy versions, when the run has them)."""
    def f(key: str, fmt: str = ".3f") -> str:
        return format(m[key], fmt) if key in m else "-"
    stages = " ".join(f"{k.split('/', 1)[1]}={v:.1f}s" for k, v in m.items() if k.startswith("seconds/"))
    optional = "".join(f" {label} {f(key)}" for label, key in (("is_w", "rollout_is_weight_mean"),
                                                                ("is_capped", "rollout_is_capped_frac"),
                                                                ("overlong_filtered", "overlong_filtered_frac"),
                                                                ("distill_kl", "distill_reverse_kl"),
                                                                ("turns", "num_turns"), ("tools", "tool_call_rate"),
                                                                ("multi_version", "multi_version_frac"))
                       if key in m)
    return (f"iter {m['iteration']:>3} | reward {f('reward_mean')}±{f('reward_std')} acc {f('accuracy')} "
            f"kl {f('kl', '.4f')} len {f('response_length', '.1f')} loss {f('policy_loss', '.4f')} "
            f"clip {f('clip_frac')}{optional} | {stages}")


def write_metrics(run_root: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """(Re)write ``{run_root}/metrics.jsonl`` with one JSON line per iteration; return its URI."""
    uri = f"{run_root.rstrip('/')}/metrics.jsonl"
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
    return uri
