"""Held-out evaluation of a checkpoint: prompts -> greedy (or sampled) rollout -> rewards -> eval shard.

The held-out prompts are the first ``eval.num_prompts`` rows of ``cfg.eval.path`` when it is set
(your own held-out file), else they come from the training task (``cfg.data``) with another
dataset seed, every question text that occurs in the training dataset dropped, so the split is
disjoint from what training can see. Rewards are graded by the training reward stage with
``cfg.reward``. With ``eval.n_samples`` > 1 (or ``eval.temperature`` > 0) each prompt gets that
many sampled answers and the eval shard's manifest adds avg@n, pass@1..n and maj@n with standard
errors per data_source and overall (``rft_core.evaluation.metrics``); greedy decoding stays the
default, with the shards, hashes and folder names it had before.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict

import tasks
from rft_core.api import (
    EvalGenerateInput,
    EvalPromptsInput,
    EvalSummaryInput,
    RewardsInput,
    check_judge_keys,
    check_run_root,
    checkpoint_label,
    default_eval_root,
    eval_markdown,
    eval_report_lines,
    heldout_fingerprint,
    resolve_checkpoint,
)
from rft_core.config import TrainConfig, load_config
from schemas import PolicyRef, ShardRef, config_hash, read_manifest, read_shard


class EvalResult(BaseModel):
    """An evaluation's headline numbers and where its shards are.

    ``accuracy``: fraction of held-out prompts whose greedy response is graded correct (sampled:
    avg@n, the mean accuracy of the answers);
    ``reward_mean``: mean training reward (correctness + format bonus) of those responses;
    ``summary``: everything of the `eval` manifest summary (standard errors, lengths, timing;
    sampled: ``metrics`` with avg@n, pass@1..n, maj@n overall and ``by_data_source``).
    """

    model_config = ConfigDict(frozen=True)
    policy: str
    out_root: str
    shard: ShardRef
    num_prompts: int
    accuracy: float
    reward_mean: float
    summary: dict[str, Any]


_SAMPLING_FIELDS = ("n_samples", "temperature", "top_p", "sampling_seed")


def _fingerprint(cfg: TrainConfig, policy: PolicyRef, max_new_tokens: int) -> str:
    """The default root's hash of the evaluation settings; the sampling fields count only when
    set, so a greedy evaluation keeps the folder name it had before they existed."""
    ev = cfg.eval.model_copy(update={"max_new_tokens": max_new_tokens}).model_dump(mode="json")
    for name in _SAMPLING_FIELDS:
        if ev[name] == type(cfg.eval).model_fields[name].default:
            del ev[name]
    return config_hash("eval-root", cfg.data, ev, cfg.reward, policy, cfg.policy.dtype)[:10]


@flow(name="rft-eval", flow_run_name="eval-{cfg.name}")
def evaluate(cfg: TrainConfig, checkpoint: str | ShardRef | None = None, out_root: str | None = None) -> EvalResult:
    """Score ``checkpoint`` on ``cfg.eval.num_prompts`` held-out prompts of the training task.

    Args:
        cfg: the training config: ``data`` (task, training seed and size: the held-out split is
            disjoint from them), ``eval`` (prompts, seed, max_new_tokens, batch), ``reward``.
        checkpoint: a model path (None: ``cfg.policy.path``, the untrained model), a
            ``ppo_update`` ShardRef, its folder or ``policy/`` sub-folder, or a run root (its
            last committed iteration).
        out_root: folder (any fsspec URI) for the prompts/rollout/rewards/eval stages; None:
            ``default_eval_root``. A rerun with the same settings reuses the committed stages.
    Returns:
        EvalResult; the per-sample rows are in ``{out_root}/eval``. A markdown artifact shows
        the numbers and the first samples.
    """
    logger = get_run_logger()
    policy = resolve_checkpoint(checkpoint if checkpoint is not None else cfg.policy.path)
    max_new = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    fingerprint = _fingerprint(cfg, policy, max_new)
    root = (out_root or default_eval_root(policy, fingerprint=fingerprint)).rstrip("/")
    check_run_root(root)  # bad storage fails here, naming the URI, before anything is written
    check_judge_keys(cfg.reward)  # an LLM judge's missing API key too
    label = checkpoint_label(policy)
    logger.info("evaluating %s on %d held-out %s prompts into %s", label, cfg.eval.num_prompts, cfg.eval.path or cfg.data.task,
                root)

    tags = tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags)
    tokenizer_path = policy if isinstance(policy, str) else cfg.policy.path
    prompts = tasks.tagged(tasks.eval_prompts, tags)(inp=EvalPromptsInput(
        data=cfg.data, eval=cfg.eval, tokenizer_path=tokenizer_path, out=f"{root}/prompts",
        data_fingerprint=heldout_fingerprint(cfg.data, cfg.eval),  # eval.path: an edited file makes it stale
        answer_required=cfg.reward.needs_reference))
    temperature, top_p = cfg.eval.decoding(cfg.rollout.temperature, cfg.rollout.top_p)
    sampling = {"n_samples": cfg.eval.n_samples, "temperature": temperature, "top_p": top_p,
                "seed": cfg.eval.sampling_seed} if cfg.eval.sampled else {}  # greedy: the defaults, its old hash
    rollout = tasks.tagged(tasks.eval_generate, tags)(inp=EvalGenerateInput(
        prompts=prompts, policy=policy, max_new_tokens=max_new, batch_size=cfg.eval.batch_size, dtype=cfg.policy.dtype,
        out=f"{root}/rollout", **sampling))
    rewards = tasks.tagged(tasks.rewards, tags)(inp=RewardsInput(rollout=rollout, prompts=prompts, reward=cfg.reward,
                                                                 out=f"{root}/rewards"))
    sampled = {"n_samples": cfg.eval.n_samples, "sampled": True} if cfg.eval.sampled else {}
    shard = tasks.tagged(tasks.eval_summary, tags)(inp=EvalSummaryInput(prompts=prompts, rollout=rollout, rewards=rewards,
                                                                        policy=policy, out=f"{root}/eval", **sampled))

    summary = read_manifest(shard.uri)[0].summary
    create_markdown_artifact(key=f"eval-{fingerprint.lower()}", markdown=eval_markdown(read_shard(shard, stage="eval"), summary),
                             description=f"Held-out evaluation of {label}")
    if "metrics" in summary:
        logger.info("held-out evaluation (%s):\n%s", shard.uri, "\n".join(eval_report_lines(summary)))
    else:
        logger.info("held-out accuracy %.3f ± %.3f, mean reward %.3f over %d prompts (%s)", summary["accuracy"],
                    summary["accuracy_stderr"], summary["reward_mean"], summary["num_prompts"], shard.uri)
    return EvalResult(policy=label, out_root=root, shard=shard, num_prompts=summary["num_prompts"],
                      accuracy=summary["accuracy"], reward_mean=summary["reward_mean"], summary=summary)


@flow(name="rft-eval-preset")
def eval_from_preset(preset: str = "configs/grpo_demo.yaml", checkpoint: str | None = None,
                     overrides: dict[str, Any] | None = None) -> EvalResult:
    """Deployment entry: load ``preset``, apply dotted ``overrides`` (``{"eval.num_prompts": 100}``)
    and evaluate ``checkpoint`` (None: the preset's initial policy; else as ``evaluate``)."""
    cfg = load_config(preset, overrides or {})
    return evaluate(cfg, checkpoint)
