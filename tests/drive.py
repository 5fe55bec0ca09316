"""Iterations without Prefect: the stage programs of ``flows/iteration.py`` in the flow's order,
in this process, each through a ``run`` callable (``run_stage``, or a resident worker's ``run``).

For places that cannot or need not start Prefect: the GPU machines (no Prefect installed,
``benchmarks/gpu_demo.py``) and unit tests of the resident workers. Dynamic sampling and critics
are not covered; ``rollout.max_staleness`` is (each rollout samples with its scheduled version),
without the overlap, and so is ``rollout.partial`` (each rollout continues the previous one's carry).
As in the flow (``flows/iteration.py``'s ``_prompts_ahead``), the next iteration's prompts run
beside the update, on a thread, and the next iteration takes them as they are (the flow's
``IterationResult.ahead_stages``). The flow stays the one place that orders stages for users.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from rft_core.api import (ActorLogprobsInput, AdvantagesInput, PPOUpdateInput, PromptsInput, RefLogprobsInput,
                          RewardsInput, RolloutInput, dataset_fingerprint, iteration_metrics, next_state, run_stage,
                          wait_for_optimizer_writes)
from rft_core.heap import freeze_grown_heap, thaw_heap
from schemas import ShardRef, stage_uri

MODEL_STAGES = ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update")


def drive(cfg, run: Callable[[Any], Any] | None = None, *, stop_after: int | None = None,
          on_iteration: Callable[[dict], None] | None = None, freeze_heap: bool = False) -> ShardRef:
    """Run iterations 1..``cfg.iterations`` (or ..``stop_after``) of ``cfg`` under
    ``cfg.run_root``; the stages that hold a model go through ``run`` (None: ``run_stage`` with
    the config's runner of the stage, as the flow runs it), the others through ``run_stage``. ``on_iteration`` gets each iteration's metrics (``iteration_metrics`` plus
    ``seconds/iteration``). The background writes (``checkpoint.async_optimizer``,
    ``checkpoint.async_weights``) are waited for before it returns, as the flow does. ``freeze_heap``:
    after each iteration freeze this process's heap once it grew, and thaw it at the end, as the
    training flow does (``rft_core.heap``; the benchmarks, which time iterations as ``rft train``
    runs them; tests leave it off). Returns the last update's ShardRef.

    Raises:
        ValueError: a config with dynamic sampling or a critic.
    """
    if cfg.dynamic_sampling.enabled or cfg.needs_critic:
        raise ValueError("tests.drive covers the demo's stages only: no dynamic sampling, no critic")
    if run is None:
        def run(inp):
            return run_stage(inp, cfg.runner(inp.program))
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rft-drive-ahead") as ahead:
            return _iterations(cfg, run, stop_after, on_iteration, freeze_heap, ahead)
    finally:
        if freeze_heap:
            thaw_heap()


def _prompts_input(cfg, it: int, carry: ShardRef | None) -> PromptsInput:
    """The prompts stage of iteration ``it`` (``carry``: the partial rollout it continues)."""
    return PromptsInput(data=cfg.data, tokenizer_path=cfg.policy.path, iteration=it,
                        out=stage_uri(cfg.run_root, it, "prompts"), data_fingerprint=dataset_fingerprint(cfg.data),
                        carry=carry)


def _iterations(cfg, run, stop_after, on_iteration, freeze_heap, ahead: ThreadPoolExecutor) -> ShardRef:
    """``drive``'s iterations (its arguments), before the heap is thawed; ``ahead`` runs the next
    iteration's prompts beside each update but the run's last."""
    policy, state = cfg.policy.path, cfg.initial_state
    versions = {0: policy}  # rollout.max_staleness: the rollout of iteration k samples with version v(k)
    carry = None
    next_prompts = None  # the next iteration's prompts, committed beside the update
    temp = cfg.rollout.temperature
    for it in range(1, (stop_after or cfg.iterations) + 1):
        def out(stage: str) -> str:
            return stage_uri(cfg.run_root, it, stage)

        t0 = time.perf_counter()
        kl = cfg.kl.model_copy(update={"kl_coef": state.kl_coef})
        prompts = next_prompts or run_stage(_prompts_input(cfg, it, carry))  # the first iteration's own
        v = cfg.rollout_policy_version(it)
        rollout = run(RolloutInput(prompts=prompts, policy=versions[v], policy_version=v, rollout=cfg.rollout,
                                   iteration=it, dtype=cfg.policy.dtype, out=out("rollout"), carry=carry))
        carry = rollout if cfg.rollout.partial is not None else None  # partial rollouts: the next one continues it
        parts = {"rewards": run_stage(RewardsInput(rollout=rollout, prompts=prompts, reward=cfg.reward, out=out("rewards")))}
        if cfg.recomputes_old_logprobs:
            parts["actor_logprobs"] = run(ActorLogprobsInput(rollout=rollout, model=policy, logprobs=cfg.logprobs,
                                                             temperature=temp, dtype=cfg.policy.dtype,
                                                             grouping=cfg.logprob_grouping_at(it),
                                                             with_sum_pi_squared=cfg.needs_sum_pi_squared,
                                                             out=out("actor_logprobs")))
        if kl.needs_reference:
            parts["ref_logprobs"] = run(RefLogprobsInput(rollout=rollout, model=cfg.reference_model.path,
                                                         logprobs=cfg.logprobs, temperature=temp,
                                                         dtype=cfg.reference_model.dtype, grouping=cfg.logprob_grouping_at(it),
                                                         out=out("ref_logprobs")))
        adv = run_stage(AdvantagesInput(rollout=rollout, rewards=parts["rewards"], actor_logprobs=parts.get("actor_logprobs"),
                                        ref_logprobs=parts.get("ref_logprobs"), kl=kl, advantage=cfg.advantage,
                                        shaping=cfg.shaping, state=state, max_new_tokens=cfg.rollout.max_new_tokens,
                                        rollout_correction=cfg.advantage_rollout_correction, out=out("advantages")))
        beside = ahead.submit(run_stage, _prompts_input(cfg, it + 1, carry)) if it < cfg.iterations else None
        policy = run(PPOUpdateInput(rollout=rollout, advantages=adv, actor_logprobs=parts.get("actor_logprobs"),
                                    ref_logprobs=parts.get("ref_logprobs"), policy=policy, update=cfg.update, kl=kl,
                                    temperature=temp, dtype=cfg.policy.dtype, save_checkpoint=cfg.is_checkpoint(it),
                                    background_checkpoint=cfg.background_checkpoint,
                                    background_optimizer=cfg.checkpoint.async_optimizer,
                                    policy_version=it - 1, out=out("ppo_update")))
        next_prompts = beside.result() if beside is not None else None
        versions[it] = policy
        state = next_state(adv)
        if on_iteration is not None:
            m = iteration_metrics(it, {"prompts": prompts, "rollout": rollout, **parts, "advantages": adv,
                                       "ppo_update": policy})
            m["seconds/iteration"] = round(time.perf_counter() - t0, 3)
            on_iteration(m)
        if freeze_heap:
            freeze_grown_heap()
    wait_for_optimizer_writes()  # as the flow: the last background writes (optimizer state, checkpoint) land first
    return policy
