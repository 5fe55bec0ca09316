"""One RL iteration as a flow: prompts -> rollout -> {actor, ref, teacher, rewards, critic values} ->
advantages -> update (policy, and critic when the estimator needs values).

Every stage is called with keywords only, with its input model (``rft_core.api``); the stage
programs decide nothing about ordering, the flow decides nothing about math.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture, wait
from pydantic import BaseModel, ConfigDict

import tasks
from flows import fanout
from rft_core.api import (
    ActorLogprobsInput,
    AdvantagesInput,
    CriticUpdateInput,
    CriticValuesInput,
    DynamicMergeInput,
    PPOUpdateInput,
    PromptsInput,
    RefLogprobsInput,
    RewardsInput,
    RolloutInput,
    TeacherLogprobsInput,
    dataset_fingerprint,
    iteration_metrics,
    next_state,
    samples_markdown,
    sync_rollout_ahead,
)
from rft_core.config import KLConfig, TrainConfig, TrainState
from schemas import PolicyRef, ShardRef, stage_uri

Out = Callable[[str], str]


class IterationResult(BaseModel):
    """What one iteration hands to the next: the new policy and the iteration's metrics."""

    model_config = ConfigDict(frozen=True)
    iteration: int
    policy: ShardRef
    critic: ShardRef | None
    next_state: TrainState
    stages: dict[str, ShardRef | None]
    metrics: dict[str, Any]
    ahead_stages: dict[str, ShardRef] = {}
    """The stages of ``iteration + 1`` committed during this iteration: {"prompts"} beside the
    update (``_prompts_ahead``), {"prompts", "rollout"} when prefetched (``_prefetch``), {} for
    none (the last iteration, dynamic sampling). The next ``rl_iteration`` takes them as they are."""


def _prompts_input(cfg: TrainConfig, iteration: int, out: Out, attempt: int, sfx: str = "",
                   carry: ShardRef | None = None) -> PromptsInput:
    """The input of the prompts of ``attempt`` of ``iteration`` (0: the iteration's own; >= 1: a
    dynamic-sampling refill); with ``carry`` (partial rollouts) the carried groups' prompt rows
    follow them."""
    return PromptsInput(
        data=cfg.data, tokenizer_path=cfg.policy.path, iteration=iteration, attempt=attempt, out=out(f"prompts{sfx}"),
        data_fingerprint=dataset_fingerprint(cfg.data),  # data.source=files: an edited file makes it stale
        answer_required=cfg.reward.needs_reference, carry=carry)


def _prompts(cfg: TrainConfig, iteration: int, out: Out, tags: bool, attempt: int, sfx: str = "",
             carry: ShardRef | None = None) -> ShardRef:
    """The committed prompts of ``_prompts_input``'s stage."""
    return tasks.tagged(tasks.prompts, tags)(inp=_prompts_input(cfg, iteration, out, attempt, sfx, carry))


def _rollout_input(cfg: TrainConfig, iteration: int, prompts: ShardRef, policy: tuple[PolicyRef, int], out: Out,
                   attempt: int, sfx: str = "", carry: ShardRef | None = None) -> RolloutInput:
    return RolloutInput(prompts=prompts, policy=policy[0], policy_version=policy[1], rollout=cfg.rollout,
                        iteration=iteration, dtype=cfg.policy.dtype, attempt=attempt, out=out(f"rollout{sfx}"),
                        carry=carry)


def previous_rollout(cfg: TrainConfig, iteration: int) -> ShardRef | None:
    """Partial rollouts (``rollout.partial``): the committed rollout of ``iteration - 1``, whose
    carried sequences the rollout of ``iteration`` continues; None otherwise (or for iteration 1).
    Read from its manifest: the previous iteration has committed before this one starts."""
    if cfg.rollout.partial is None or iteration == 1:
        return None
    return ShardRef.from_manifest(stage_uri(cfg.run_root, iteration - 1, "rollout"))


def _attempt(cfg: TrainConfig, iteration: int, policy: tuple[PolicyRef, int], out: Out, tags: bool, attempt: int,
             sfx: str = "", carry: ShardRef | None = None,
             committed: dict[str, ShardRef] | None = None) -> tuple[ShardRef, ShardRef]:
    """The prompts and rollout of ``attempt`` (0: the iteration's own; >= 1: a dynamic-sampling
    refill), sampled with ``policy`` (the policy and its version), continuing ``carry``'s sequences.
    ``committed``: those of them the previous iteration committed ahead (its ``ahead_stages``),
    taken as they are, without a task run that would only find them committed."""
    committed = committed or {}
    prompts = committed.get("prompts") or _prompts(cfg, iteration, out, tags, attempt, sfx, carry)
    rollout = committed.get("rollout") or fanout.rollout(
        inp=_rollout_input(cfg, iteration, prompts, policy, out, attempt, sfx, carry),
        runner=cfg.runner("rollout"), ray=cfg.ray, tags=tags)
    return prompts, rollout


def _dynamic_sampling(cfg: TrainConfig, iteration: int, policy: tuple[PolicyRef, int], out: Out,
                      tags: bool) -> tuple[ShardRef, ShardRef, ShardRef]:
    """Rollout attempts (each with its own stage folders) until enough groups have reward
    spread or the refills run out; then the merge stage writes prompts/rollout/rewards."""
    target = cfg.data.prompts_per_iteration
    attempts: list[tuple[ShardRef, ShardRef, ShardRef]] = []
    for attempt in range(cfg.dynamic_sampling.max_refills + 1):
        sfx = f"-try{attempt}"
        p, r = _attempt(cfg, iteration, policy, out, tags, attempt, sfx)
        w = tasks.tagged(tasks.rewards, tags)(inp=RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=out(f"rewards{sfx}")))
        attempts.append((p, r, w))
        if tasks.tagged(tasks.signal_groups, tags)(attempt_rewards=[a[2] for a in attempts]) >= target:
            break
    return tasks.tagged(tasks.dynamic_merge, tags)(inp=DynamicMergeInput(
        attempts=attempts, target_groups=target, out=out("prompts"), out_rollout=out("rollout"), out_rewards=out("rewards")))


def _greedy_baseline(cfg: TrainConfig, iteration: int, prompts: ShardRef, policy: tuple[PolicyRef, int], out: Out,
                     tags: bool) -> dict[str, ShardRef]:
    """ReMax's baseline (an estimator with ``EstimatorInfo.greedy_baseline``): one greedy response
    per prompt from the rollout's own policy (the rollout stage with ``greedy``, where the rollout
    runs, unsharded) and its reward: {"baseline_rollout", "baseline_rewards"}; {} for the others."""
    if not cfg.needs_greedy_baseline:
        return {}
    rollout = tasks.tagged(tasks.rollout, tags)(inp=RolloutInput(
        prompts=prompts, policy=policy[0], policy_version=policy[1], rollout=cfg.rollout, iteration=iteration,
        dtype=cfg.policy.dtype, greedy=True, out=out("baseline_rollout")),
        runner=cfg.runner("rollout").model_copy(update={"shards": 1}))
    rewards = tasks.tagged(tasks.rewards, tags)(inp=RewardsInput(rollout=rollout, prompts=prompts, reward=cfg.reward,
                                                                 out=out("baseline_rewards")))
    return {"baseline_rollout": rollout, "baseline_rewards": rewards}


def _score(cfg: TrainConfig, iteration: int, *, prompts: ShardRef, rollout: ShardRef, policy: PolicyRef,
           critic: PolicyRef | None, kl: KLConfig, out: Out, tags: bool, with_rewards: bool) -> dict[str, ShardRef]:
    """The stages that read only the rollout, submitted together (they run concurrently): rewards
    (unless dynamic sampling wrote them), actor log-probs (when old log-probs are recomputed),
    critic values (estimators with a critic), reference log-probs (a KL coefficient > 0),
    teacher log-probs (on-policy distillation: teacher.path set)."""
    temp, grouping = cfg.rollout.temperature, cfg.logprob_grouping_at(iteration)  # below float32: the update's rows
    futures: dict[str, PrefectFuture] = {}
    if cfg.recomputes_old_logprobs:
        futures["actor_logprobs"] = tasks.tagged(tasks.actor_logprobs, tags).submit(inp=ActorLogprobsInput(
            rollout=rollout, model=policy, logprobs=cfg.logprobs, temperature=temp, dtype=cfg.policy.dtype,
            grouping=grouping, with_sum_pi_squared=cfg.needs_sum_pi_squared, out=out("actor_logprobs")),
            runner=cfg.runner("actor_logprobs"))
    if critic is not None:
        futures["critic_values"] = tasks.tagged(tasks.critic_values, tags).submit(inp=CriticValuesInput(
            rollout=rollout, model=critic, critic=cfg.critic, out=out("critic_values")), runner=cfg.runner("critic_values"))
    if kl.needs_reference:
        futures["ref_logprobs"] = tasks.tagged(tasks.ref_logprobs, tags).submit(inp=RefLogprobsInput(
            rollout=rollout, model=cfg.reference_model.path, logprobs=cfg.logprobs, temperature=temp,
            dtype=cfg.reference_model.dtype, grouping=grouping, out=out("ref_logprobs")),
            runner=cfg.runner("ref_logprobs"))
    if cfg.teacher.path is not None:  # on-policy distillation: the teacher scores the student's tokens
        futures["teacher_logprobs"] = tasks.tagged(tasks.teacher_logprobs, tags).submit(inp=TeacherLogprobsInput(
            rollout=rollout, model=cfg.teacher.path, logprobs=cfg.logprobs, temperature=cfg.teacher_temperature,
            dtype=cfg.teacher.dtype, tokenizer_path=cfg.policy.path, out=out("teacher_logprobs")),
            runner=cfg.runner("teacher_logprobs"))
    if with_rewards:  # submitted last: the model stages' calls start first (a submission takes 3-14 ms)
        futures["rewards"] = tasks.tagged(tasks.rewards, tags).submit(inp=RewardsInput(
            rollout=rollout, prompts=prompts, reward=cfg.reward, out=out("rewards")))
    wait(list(futures.values()))  # when one fails, the others still commit (a retry reuses them), then it raises
    return {name: f.result() for name, f in futures.items()}


def train_on(cfg: TrainConfig, parts: dict[str, ShardRef], *, policy: PolicyRef, critic: PolicyRef | None,
             state: TrainState, kl: KLConfig, out: Out, tags: bool,
             background_optimizer: bool, save_checkpoint: bool = True,
             policy_version: int | None = None,
             beside_update: Callable[[], None] | None = None) -> tuple[ShardRef, ShardRef, ShardRef | None]:
    """Advantages, then the policy update and (with a ``critic`` and critic values in ``parts``)
    the critic update, submitted together: (advantages, new policy, new critic or None).
    ``parts`` holds the rollout, rewards and whichever of actor_logprobs, ref_logprobs,
    critic_values, teacher_logprobs and baseline_rollout / baseline_rewards (remax) ran.
    ``save_checkpoint``: the update writes the new weights and AdamW state (``checkpoint.every``); ``policy_version``: the version ``policy`` is (recorded by the update; with update.seed it seeds
    its micro-batch order and dropout masks). ``beside_update``: called once the advantages
    commit, right before the update starts (the iteration flow submits the next iteration's
    prompts there, to run beside the update). The iteration flow and the replay flow both train through here."""
    rollout, actor, ref, values = parts["rollout"], parts.get("actor_logprobs"), parts.get("ref_logprobs"), parts.get("critic_values")
    adv = tasks.tagged(tasks.advantages, tags)(inp=AdvantagesInput(
        rollout=rollout, rewards=parts["rewards"], actor_logprobs=actor, ref_logprobs=ref, critic_values=values, kl=kl,
        advantage=cfg.advantage, shaping=cfg.shaping, state=state, max_new_tokens=cfg.rollout.max_new_tokens,
        baseline_rollout=parts.get("baseline_rollout"), baseline_rewards=parts.get("baseline_rewards"),
        rollout_correction=cfg.advantage_rollout_correction, teacher_logprobs=parts.get("teacher_logprobs"),
        teacher=cfg.teacher, out=out("advantages")))
    if beside_update is not None:
        beside_update()
    critic_future = None
    if critic is not None and values is not None:
        critic_future = tasks.tagged(tasks.critic_update, tags).submit(inp=CriticUpdateInput(
            rollout=rollout, advantages=adv, critic_values=values, model=critic, critic=cfg.critic,
            out=out("critic_update")), runner=cfg.runner("critic_update"))
    new_policy = tasks.tagged(tasks.ppo_update, tags)(inp=PPOUpdateInput(
        rollout=rollout, advantages=adv, actor_logprobs=actor, ref_logprobs=ref, policy=policy, update=cfg.update, kl=kl,
        temperature=cfg.rollout.temperature, dtype=cfg.policy.dtype, background_optimizer=background_optimizer,
        save_checkpoint=save_checkpoint, policy_version=policy_version, background_checkpoint=cfg.background_checkpoint,
        out=out("ppo_update")),
        runner=cfg.runner("ppo_update"))
    return adv, new_policy, critic_future.result() if critic_future is not None else None


def _next_uri(cfg: TrainConfig, iteration: int) -> Out:
    """The stage folders of ``iteration + 1``."""
    return lambda stage: stage_uri(cfg.run_root, iteration + 1, stage)


def _prefetch(cfg: TrainConfig, iteration: int, rollout: ShardRef, next_policy: PolicyRef | None,
              tags: bool) -> dict[str, ShardRef | PrefectFuture]:
    """Asynchronous RL: the prompts and rollout of ``iteration + 1``, sampled with ``next_policy``
    (already trained): {"prompts": committed, "rollout": submitted to run during this iteration's
    update}; a partial rollout continues ``rollout``'s carried sequences. {} where nothing is
    prefetched (synchronous, the last iteration, dynamic sampling, a sharded rollout)."""
    if next_policy is None or iteration >= cfg.iterations or cfg.dynamic_sampling.enabled \
            or cfg.runner("rollout").shards != 1:
        return {}
    carry = rollout if cfg.rollout.partial is not None else None
    next_prompts = _prompts(cfg, iteration + 1, _next_uri(cfg, iteration), tags, attempt=0, carry=carry)
    return {"prompts": next_prompts, "rollout": tasks.tagged(tasks.rollout, tags).submit(inp=_rollout_input(
        cfg, iteration + 1, next_prompts, (next_policy, cfg.rollout_policy_version(iteration + 1)),
        _next_uri(cfg, iteration), attempt=0, carry=carry), runner=cfg.runner("rollout"))}


def _prompts_ahead(cfg: TrainConfig, iteration: int, rollout: ShardRef, tags: bool) -> dict[str, PrefectFuture]:
    """Where nothing of ``iteration + 1`` is prefetched (``_prefetch``): {"prompts": its prompts},
    submitted once this iteration's advantages commit, to run beside its update ({} for the last
    iteration and under dynamic sampling, whose attempts decide the prompts). They depend on the
    data, the iteration and (partial rollouts) the sequences this iteration's ``rollout``
    carries, never on the update, and the next iteration takes them as they are (this
    iteration's ``ahead_stages``; on a resume its own call finds them committed), so it starts
    with its rollout: its prompts cost 0.05-0.16 s on the critical path before, on a 2-core CPU
    whose cores the weight sync ahead used too (docs/benchmarks.md). The Prefect UI shows that
    prompts task under this iteration's flow run."""
    if iteration >= cfg.iterations or cfg.dynamic_sampling.enabled:
        return {}
    carry = rollout if cfg.rollout.partial is not None else None
    return {"prompts": tasks.tagged(tasks.prompts, tags).submit(
        inp=_prompts_input(cfg, iteration + 1, _next_uri(cfg, iteration), 0, carry=carry))}


@flow(name="rl-iteration", flow_run_name="iter-{iteration:06d}")
def rl_iteration(cfg: TrainConfig, iteration: int, policy: PolicyRef, state: TrainState | None = None,
                 critic: PolicyRef | None = None, rollout_policy: PolicyRef | None = None,
                 next_rollout_policy: PolicyRef | None = None,
                 ahead_stages: dict[str, ShardRef] | None = None) -> IterationResult:
    """Run (or resume) iteration ``iteration`` starting from ``policy``, ``state`` (the previous
    iteration's ``next_state``; None: ``cfg.initial_state``) and, for estimators that need
    values, ``critic`` (None: ``cfg.initial_critic``).

    Asynchronous RL (``rollout.max_staleness`` s >= 1): the rollout samples with
    ``rollout_policy``, version ``cfg.rollout_policy_version(iteration)`` (None: ``policy``, the
    synchronous case), and ``next_rollout_policy`` (version ``cfg.rollout_policy_version(iteration
    + 1)``, already trained) lets the prompts and rollout of the next iteration run during this
    iteration's update: submitted before it, awaited after it, and handed to the next iteration
    (``ahead_stages``). Otherwise the next iteration's prompts alone run beside this
    iteration's update (``_prompts_ahead``). Partial rollouts (``rollout.partial``): the prompts and the
    rollout continue the sequences the previous iteration's rollout carried (``previous_rollout``).
    ``ahead_stages``: the previous result's ``ahead_stages``, taken as they are (None: each
    stage's task runs, finding them committed on a resume)."""
    t0 = time.perf_counter()
    state = state or cfg.initial_state
    kl = cfg.kl.model_copy(update={"kl_coef": state.kl_coef})
    tags = tasks.resolve_concurrency_tags(cfg.orchestration.concurrency_tags)
    critic = (critic or cfg.initial_critic) if cfg.needs_critic else None

    def out(stage: str) -> str:
        return stage_uri(cfg.run_root, iteration, stage)

    behaviour = (rollout_policy if rollout_policy is not None else policy, cfg.rollout_policy_version(iteration))
    if cfg.dynamic_sampling.enabled:
        prompts, rollout, rewards = _dynamic_sampling(cfg, iteration, behaviour, out, tags)
        parts = {"rewards": rewards}
    else:
        prompts, rollout = _attempt(cfg, iteration, behaviour, out, tags, attempt=0,
                                    carry=previous_rollout(cfg, iteration), committed=ahead_stages)
        parts = {}
    parts |= _score(cfg, iteration, prompts=prompts, rollout=rollout, policy=policy, critic=critic, kl=kl, out=out,
                    tags=tags, with_rewards=not parts)
    parts |= _greedy_baseline(cfg, iteration, prompts, behaviour, out, tags)  # remax; {} for the other estimators
    # the next iteration's prompts and rollout, prefetched; without a prefetch: its prompts, beside the update
    ahead: dict[str, ShardRef | PrefectFuture] = _prefetch(cfg, iteration, rollout, next_rollout_policy, tags)
    adv, new_policy, new_critic = train_on(cfg, {"rollout": rollout, **parts}, policy=policy, critic=critic, state=state,
                                           kl=kl, out=out, tags=tags, background_optimizer=cfg.checkpoint.async_optimizer,
                                           save_checkpoint=cfg.is_checkpoint(iteration), policy_version=iteration - 1,
                                           beside_update=None if ahead else
                                           lambda: ahead.update(_prompts_ahead(cfg, iteration, rollout, tags)))
    if cfg.syncs_rollout_ahead(iteration):  # the next rollout's weights move while this iteration commits
        sync_rollout_ahead(cfg.runner("rollout").workers, new_policy, cfg.policy.dtype)
    # overlapped with this update: a failure surfaces here
    committed_ahead = {k: v.result() if isinstance(v, PrefectFuture) else v for k, v in ahead.items()}
    refs = {"prompts": prompts, "rollout": rollout, **parts, "advantages": adv, "ppo_update": new_policy,
            **({"critic_update": new_critic} if new_critic else {})}
    metrics = iteration_metrics(iteration, refs)
    metrics["seconds/iteration"] = round(time.perf_counter() - t0, 3)
    create_table_artifact(key=f"metrics-iter-{iteration:06d}", table=[metrics],
                          description=f"Metrics of iteration {iteration}")
    create_markdown_artifact(key=f"samples-iter-{iteration:06d}", markdown=samples_markdown(cfg.run_root, iteration),
                             description=f"Sample prompts, responses and rewards of iteration {iteration}")
    get_run_logger().info("iteration %d committed: %s", iteration, new_policy.uri)
    return IterationResult(iteration=iteration, policy=new_policy, critic=new_critic, next_state=next_state(adv),
                           stages=refs, metrics=metrics, ahead_stages=committed_ahead)
