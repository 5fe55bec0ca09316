"""One RL iteration as a flow: prompts -> rollout -> {actor, ref, rewards} -> advantages -> update."""
from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict

import tasks
from flows import fanout
from rft_core.config import TrainConfig, TrainState
from rft_core.metrics import iteration_metrics
from rft_core.observe import samples_markdown
from rft_core.stages.common import PolicyRef
from schemas import ShardRef, read_manifest, stage_uri


class IterationResult(BaseModel):
    """What one iteration hands to the next: the new policy and the iteration's metrics."""

    model_config = ConfigDict(frozen=True)
    iteration: int
    policy: ShardRef
    critic: ShardRef | None
    next_state: TrainState
    stages: dict[str, ShardRef | None]
    metrics: dict[str, Any]


def _dynamic_sampling(cfg: TrainConfig, iteration: int, policy: PolicyRef, out,
                      st: tasks.StageTasks) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Rollout attempts (each with its own stage folders) until enough groups have reward
    spread or the refills run out; then the merge stage writes prompts/rollout/rewards."""
    target = cfg.data.prompts_per_iteration
    attempts = []
    for attempt in range(cfg.dynamic_sampling.max_refills + 1):
        sfx = f"-try{attempt}"
        p = st.prompts(cfg.data, cfg.policy.path, iteration, out(f"prompts{sfx}"), attempt)
        r = fanout.rollout(p, policy, cfg.rollout, iteration, out(f"rollout{sfx}"), cfg.policy.dtype, attempt,
                           cfg.runner("rollout"), st)
        w = st.rewards(r, p, cfg.reward, out(f"rewards{sfx}"))
        attempts.append((p, r, w))
        if st.signal_groups([a[2] for a in attempts]) >= target:
            break
    return st.dynamic_merge(attempts, target, out("prompts"), out("rollout"), out("rewards"))


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}")
def rl_iteration(cfg: TrainConfig, iteration: int, policy: PolicyRef, state: TrainState | None = None,
                 critic: PolicyRef | None = None) -> IterationResult:
    """Run (or resume) iteration ``iteration`` starting from ``policy``, ``state`` (the previous
    iteration's ``next_state``; None: ``cfg.initial_state``) and, for estimators that need
    values, ``critic`` (None: ``cfg.initial_critic``)."""
    t0 = time.perf_counter()
    state = state or cfg.initial_state
    kl = cfg.kl.model_copy(update={"kl_coef": state.kl_coef})

    def out(stage: str) -> str:
        return stage_uri(cfg.run_root, iteration, stage)

    dtype, temp = cfg.policy.dtype, cfg.rollout.temperature
    st = tasks.StageTasks(tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags))
    futures = {}
    if cfg.dynamic_sampling.enabled:
        prompts, rollout, rewards = _dynamic_sampling(cfg, iteration, policy, out, st)
    else:
        prompts = st.prompts(cfg.data, cfg.policy.path, iteration, out("prompts"))
        rollout = fanout.rollout(prompts, policy, cfg.rollout, iteration, out("rollout"), dtype, 0, cfg.runner("rollout"), st)
        rewards = None

    # independent of each other: submitted together, run concurrently
    if rewards is None:
        futures["rewards"] = st.rewards.submit(rollout, prompts, cfg.reward, out("rewards"))
    if cfg.logprobs.recompute_old_logprobs:
        futures["actor_logprobs"] = st.actor_logprobs.submit(rollout, policy, cfg.logprobs, temp, out("actor_logprobs"), dtype,
                                                             runner=cfg.runner("actor_logprobs"))
    if cfg.needs_critic:
        critic = critic or cfg.initial_critic
        futures["critic_values"] = st.critic_values.submit(rollout, critic, cfg.critic, out("critic_values"),
                                                           runner=cfg.runner("critic_values"))
    if kl.needs_reference:
        futures["ref_logprobs"] = st.ref_logprobs.submit(rollout, cfg.reference_model.path, cfg.logprobs, temp,
                                                         out("ref_logprobs"), cfg.reference_model.dtype,
                                                         runner=cfg.runner("ref_logprobs"))
    parts = {name: f.result() for name, f in futures.items()}
    if rewards is not None:
        parts["rewards"] = rewards
    actor, ref, values = parts.get("actor_logprobs"), parts.get("ref_logprobs"), parts.get("critic_values")

    adv = st.advantages(rollout, parts["rewards"], actor, ref, values, kl, cfg.advantage, cfg.shaping, state,
                        cfg.rollout.max_new_tokens, out("advantages"))
    # the policy and the critic train on the same experience, independently: submitted together
    critic_future = (st.critic_update.submit(rollout, adv, values, critic, cfg.critic, out("critic_update"),
                                             runner=cfg.runner("critic_update"))
                     if values is not None else None)
    new_policy = st.ppo_update(rollout, adv, actor, ref, policy, cfg.update, kl, temp, out("ppo_update"), dtype,
                               runner=cfg.runner("ppo_update"), background_optimizer=cfg.checkpoint.async_optimizer)
    new_critic = critic_future.result() if critic_future is not None else None

    refs = {"prompts": prompts, "rollout": rollout, **parts, "advantages": adv, "ppo_update": new_policy,
            **({"critic_update": new_critic} if new_critic else {})}
    metrics = iteration_metrics(iteration, refs)
    metrics["seconds/iteration"] = round(time.perf_counter() - t0, 3)
    create_table_artifact(key=f"metrics-iter-{iteration:06d}", table=[metrics],
                          description=f"Metrics of iteration {iteration}")
    create_markdown_artifact(key=f"samples-iter-{iteration:06d}", markdown=samples_markdown(cfg.run_root, iteration),
                             description=f"Sample prompts, responses and rewards of iteration {iteration}")
    get_run_logger().info("iteration %d committed: %s", iteration, new_policy.uri)
    next_state = TrainState.model_validate(read_manifest(adv.uri)[0].summary["next_state"])
    return IterationResult(iteration=iteration, policy=new_policy, critic=new_critic, next_state=next_state, stages=refs,
                           metrics=metrics)
