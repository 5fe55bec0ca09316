"""Settings that contradict each other, refused when the config loads (before any stage).

Each ``Rule`` looks at a whole ``TrainConfig`` and returns ``None`` or a one-line message that
names both keys and the fix. ``TrainConfig``'s validator runs ``CONTRADICTIONS`` (and the older
checks that live beside the fields they concern); docs/config.md lists every rule with its
keys, and ``tests/rft_core/config/test_rules.py`` has a case per row.

The rules here are the ones a user of verl, OpenRLHF or TRL can get wrong without any single
field being invalid: a group baseline with one sample per group (every advantage is 0), an
adaptive KL controller started at 0 (it only scales the coefficient, so it stays 0), a reward
source whose inputs the configured prompts never carry. Checks that need the data itself (a
missing answer, a label the grader does not know) run on the whole dataset before the first
stage (``rft_core.data.validate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rft_core.algorithms import ADVANTAGE_ESTIMATORS
from rft_core.data.prompts import is_reasoning_gym_dataset

BUILTIN_CODE_TASKS = ("humaneval",)


@dataclass(frozen=True)
class Rule:
    """A cross-field rule.

    Attributes:
        name: short id (the row of docs/config.md).
        keys: the config keys involved, as a user writes them.
        check: ``cfg -> message | None``; the message names every key in ``keys`` and the fix.
    """

    name: str
    keys: tuple[str, ...]
    check: Callable[[Any], str | None]


def dataset_grader_keys(cfg: Any) -> list[str]:
    """The keys that make the reward use reasoning-gym's own scorer (grader ``dataset``):
    ``reward.grader`` for the implicit recipe, ``reward.sources.<name>.grader`` for each
    ``math_answer`` source that uses it. Empty when no reward term needs it."""
    reward = cfg.reward
    if not reward.sources:
        return ["reward.grader"] if reward.grader == "dataset" else []
    return [f"reward.sources.{name}.grader" for name, src in reward.sources.items()
            if src.type == "math_answer" and src.grader == "dataset"]


def _distill_alone(cfg: Any) -> bool:
    """On-policy distillation without the task advantages (teacher.use_task_rewards false)."""
    return cfg.teacher.path is not None and not cfg.teacher.use_task_rewards


def _group_one_sample(cfg: Any) -> str | None:
    name = cfg.advantage.estimator
    info = ADVANTAGE_ESTIMATORS.info(name)
    if _distill_alone(cfg):  # the estimator's advantages are not used: one sample per prompt is fine
        return None
    if (info.group_baseline or info.needs_sum_pi_squared) and cfg.rollout.n_samples_per_prompt < 2:
        # the optimal token baseline of a group of one is 0 (verl: "the baseline collapses to returns")
        what = "no baseline (the advantages are the plain returns)" if info.needs_sum_pi_squared else "every advantage 0"
        return (f"advantage.estimator={name} subtracts a baseline of each prompt's group of samples, but "
                f"rollout.n_samples_per_prompt=1 makes every group one sample and {what}: set "
                "rollout.n_samples_per_prompt >= 2 (GRPO's paper uses 64, the demo 4) or advantage.estimator=reinforce "
                "(or gae) for one sample per prompt")
    return None


def _pass_at_k_beyond_group(cfg: Any) -> str | None:
    adv, n = cfg.advantage, cfg.rollout.n_samples_per_prompt
    if adv.estimator == "pass_at_k" and adv.k > n:
        return (f"advantage.k={adv.k} exceeds rollout.n_samples_per_prompt={n}: pass@k is taken over k-subsets of each "
                "prompt's group of samples (Chen et al. 2025, arXiv:2508.10751), so k must be between 1 and the group "
                f"size: set advantage.k <= {n} (k = {n} gives every group zero advantages; the smallest k > 1 is 2) or "
                "more samples per prompt")
    return None


def _remax_with_agent(cfg: Any) -> str | None:
    if cfg.needs_greedy_baseline and cfg.rollout.agent is not None:
        return (f"advantage.estimator={cfg.advantage.estimator} subtracts the reward of a greedy single-turn response "
                "of each prompt (ReMax, arXiv:2310.10505), which a multi-turn rollout (rollout.agent) has no "
                "counterpart of: unset rollout.agent or choose another estimator (e.g. rloo)")
    return None


def _sum_pi_squared_without_actor(cfg: Any) -> str | None:
    if cfg.needs_sum_pi_squared and cfg.logprobs.recompute_old_logprobs is False:
        return (f"advantage.estimator={cfg.advantage.estimator} weighs its baseline by sum_v pi_old(v)^2 at every "
                "response token, which only the actor stage computes (verl: actor.calculate_sum_pi_squared), but "
                "logprobs.recompute_old_logprobs=false skips that stage: set logprobs.recompute_old_logprobs=auto "
                "(or true) or choose another estimator (e.g. grpo)")
    return None


DPPO_LOSSES = ("dppo_tv", "dppo_kl")


def _dppo_anchor(cfg: Any) -> str | None:
    name = cfg.update.policy_loss.name
    if name in DPPO_LOSSES and cfg.recomputes_old_logprobs:
        why = cfg.old_logprobs_blockers() if cfg.logprobs.recompute_old_logprobs == "auto" else []
        ran = f"runs the actor pass here ({why[0]})" if why else "runs the actor pass"
        return (f"update.policy_loss.name={name} measures its ratio and trust region against the policy that sampled "
                "the tokens, the rollout's log-probs (Qi et al. 2026, arXiv:2602.04879, eq. 11), but "
                f"logprobs.recompute_old_logprobs={str(cfg.logprobs.recompute_old_logprobs).lower()} {ran}, whose "
                "log-probs would take their place (verl's default, the authors' *_recompute ablation): set "
                "logprobs.recompute_old_logprobs=false, or another policy loss (e.g. ppo_clip)")
    return None


def _gdpo_reward_weights(cfg: Any) -> str | None:
    if cfg.advantage.estimator != "gdpo":
        return None
    reward = cfg.reward.resolved
    given = cfg.advantage.reward_weights
    if given is not None:
        unknown = sorted(set(given) - set(reward.sources))
        if unknown:
            return (f"advantage.reward_weights names {unknown}, which reward.sources does not define (defined: "
                    f"{', '.join(reward.sources)}): GDPO normalises the score of each reward source within its group "
                    "(arXiv:2601.05242): name defined sources")
        return None
    weighted = [(label, item) for label, items in reward.recipes.items() for item in items if item.weight != 1.0]
    if weighted:
        label, item = weighted[0]
        recipe = ", ".join(f"{i.source}: {i.weight:g}" for i in reward.recipes[label])
        return (f"advantage.estimator=gdpo sums the group-normalised scores of the reward sources with "
                f"advantage.reward_weights, left out: weight 1 each, but reward.recipes.{label} weighs {item.source} "
                f"{item.weight:g} (GDPO, arXiv:2601.05242, normalises each reward before the weighted sum, so the "
                f"recipe's weights do not carry over): set advantage.reward_weights (e.g. {{{recipe}}})")
    return None


def _gdpo_scalar_shaping(cfg: Any) -> str | None:
    sh = cfg.shaping
    keys = [k for k, on in (("shaping.overlong_buffer_len", sh.overlong_buffer_len is not None),
                            ("shaping.reward_running_norm", sh.reward_running_norm),
                            ("shaping.reward_clip", sh.reward_clip is not None)) if on]
    if cfg.advantage.estimator == "gdpo" and keys:
        return (f"advantage.estimator=gdpo reads each reward source's own score (reward_metrics), not the summed "
                f"reward that {keys[0]} shapes, so that step would change nothing: unset {keys[0]} (a length "
                "penalty can be a reward source of its own), or choose another estimator (e.g. grpo)")
    return None


def _dynamic_one_sample(cfg: Any) -> str | None:
    if cfg.dynamic_sampling.enabled and cfg.rollout.n_samples_per_prompt < 2:
        return ("dynamic_sampling.enabled=true drops groups whose rewards are all equal, and with "
                "rollout.n_samples_per_prompt=1 every group is: set rollout.n_samples_per_prompt >= 2 or "
                "dynamic_sampling.enabled=false")
    return None


def _train_batch_beyond_rollout(cfg: Any) -> str | None:
    size = cfg.data.prompts_per_iteration * cfg.rollout.n_samples_per_prompt
    tb = cfg.update.train_batch_size
    if tb is not None and tb > size:
        return (f"update.train_batch_size={tb} samples per optimizer step, but a rollout has only "
                f"data.prompts_per_iteration x rollout.n_samples_per_prompt = {cfg.data.prompts_per_iteration} x "
                f"{cfg.rollout.n_samples_per_prompt} = {size}: set update.train_batch_size <= {size} (or null: the "
                "whole rollout in one step), or generate more per iteration")
    return None


def _adaptive_kl_from_zero(cfg: Any) -> str | None:
    if cfg.kl.controller == "adaptive" and cfg.kl.kl_coef == 0:
        return ("kl.controller=adaptive scales the coefficient up or down from kl.kl_coef (Ziegler et al. 2019, "
                "eq. 2), and from kl.kl_coef=0 it stays 0: set kl.kl_coef > 0 (e.g. 0.05) or kl.controller=fixed")
    return None


def _overlong_buffer_too_long(cfg: Any) -> str | None:
    buf = cfg.shaping.overlong_buffer_len
    if buf is not None and buf >= cfg.rollout.max_new_tokens:
        return (f"shaping.overlong_buffer_len={buf} is the window before rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens} where DAPO's soft penalty grows (arXiv:2503.14476, eq. 13); it must be "
                "shorter than the response budget: set shaping.overlong_buffer_len < rollout.max_new_tokens")
    return None


def _environment_without_agent(cfg: Any) -> str | None:
    names = [n for n, s in cfg.reward.sources.items() if s.type == "environment"]
    if names and cfg.rollout.agent is None:
        return (f"reward.sources.{names[0]}.type=environment scores the environment's reward of a multi-turn "
                "rollout, but rollout.agent is not set (single-turn rollouts have no environment): set rollout.agent "
                "(docs/agents.md) or use another reward source")
    return None


def _code_exec_without_tests(cfg: Any) -> str | None:
    names = [n for n, s in cfg.reward.sources.items() if s.type == "code_exec"]
    if names and cfg.data.source == "reasoning_gym" and cfg.data.task not in BUILTIN_CODE_TASKS:
        return (f"reward.sources.{names[0]}.type=code_exec runs each response against its problem's unit tests, "
                f"but data.task={cfg.data.task} (reasoning-gym) has none: set data.task=humaneval, or "
                "data.source=files with rows that carry test and entry_point")
    return None


def _dataset_grader_with_foreign_labels(cfg: Any) -> str | None:
    if cfg.data.source != "files":
        return None
    keys = dataset_grader_keys(cfg)
    labels = [s.data_source for s in cfg.data.sources if s.data_source is not None]
    foreign = [label for label in labels if not is_reasoning_gym_dataset(label)]
    if keys and foreign:
        return (f"{keys[0]}=dataset grades with the reasoning-gym dataset named by each row's label, but "
                f"data.sources labels rows {foreign[0]!r}, which is not one (data.source=files): set {keys[0]}="
                "math_verify (symbolic math answers) or use an exact_match source")
    return None


def _stale_untruncated_weights(cfg: Any) -> str | None:
    rc, s = cfg.update.rollout_correction, cfg.rollout.max_staleness
    if s >= 1 and rc.enabled and rc.mode == "seq-mask-tis":
        return (f"update.rollout_correction.mode=seq-mask-tis bounds only each response's geometric-mean ratio and "
                "keeps every token's weight pi_proximal / pi_behaviour untruncated (OpenRLHF's code), but "
                f"rollout.max_staleness={s} samples with a policy {s} update(s) older than the proximal one, where "
                "single tokens get unbounded weights; AReaL's decoupled objective (arXiv:2505.24298, eq. 5) caps every "
                "token's weight (behav_imp_weight_cap): set update.rollout_correction.mode=tis with "
                f"update.rollout_correction.rejection=seq_mean_k1 and rejection_cap={rc.cap:g} (the same geometric-mean "
                "filter, with token weights truncated at cap: verl's Geo-RS-Token-TIS), or mode=icepop")
    return None


def _partial_needs_staleness(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.partial is not None and r.max_staleness < 1:
        return (f"rollout.partial.chunk_tokens={r.partial.chunk_tokens} continues a sequence under a newer policy than "
                f"the one that started it, but rollout.max_staleness=0 trains as if every token were on-policy: set "
                "rollout.max_staleness=1 (decoupled PPO: the actor pass and the rollout correction weigh every token "
                "by its own behaviour policy), or unset rollout.partial")
    return None


def _partial_chunk_covers_response(cfg: Any) -> str | None:
    r = cfg.rollout
    if r.partial is not None and r.partial.chunk_tokens >= r.max_new_tokens:
        return (f"rollout.partial.chunk_tokens={r.partial.chunk_tokens} is not below rollout.max_new_tokens="
                f"{r.max_new_tokens}: every response would be generated whole in its first rollout and nothing would "
                f"carry over: set rollout.partial.chunk_tokens < {r.max_new_tokens}, or unset rollout.partial")
    return None


def _partial_single_turn(cfg: Any) -> str | None:
    """Partial rollouts continue single-turn responses of the plain rollout stage; the settings
    that generate otherwise (an agent loop, dynamic sampling's refills, ReMax's greedy baseline,
    the Ray fan-out's merge) are not built for sequences that span rollouts."""
    if cfg.rollout.partial is None:
        return None
    rollout_runner = cfg.runners.get("rollout")
    other = [k for k, on in (
        ("rollout.agent (a multi-turn trajectory is not continued across rollouts)", cfg.rollout.agent is not None),
        ("dynamic_sampling.enabled (its refills would start groups that cannot carry over)", cfg.dynamic_sampling.enabled),
        (f"advantage.estimator={cfg.advantage.estimator} (its greedy baseline rollout would need the carried prompts)",
         ADVANTAGE_ESTIMATORS.info(cfg.advantage.estimator).greedy_baseline),
        (f"runners.rollout.shards={rollout_runner.shards if rollout_runner else 1} (the shards' merge does not carry "
         "sequences over)", rollout_runner is not None and rollout_runner.shards > 1)) if on]
    if other:
        return (f"rollout.partial continues single-turn responses in one rollout stage, but {other[0]} is set: unset "
                "rollout.partial, or remove that setting")
    return None


def _distill_alone_task_settings(cfg: Any) -> str | None:
    """With teacher.use_task_rewards false the advantages are the distillation signal alone, so a
    setting that only acts on the task reward or its advantages, or runs a stage for them, would
    change nothing (or compute for nothing)."""
    if not _distill_alone(cfg):
        return None
    info = ADVANTAGE_ESTIMATORS.info(cfg.advantage.estimator)
    sh = cfg.shaping
    unused = [k for k, on in (
        (f"advantage.estimator={cfg.advantage.estimator} (it needs a critic)", info.needs_critic),
        (f"advantage.estimator={cfg.advantage.estimator} (it runs a greedy baseline rollout)", info.greedy_baseline),
        ("kl.mode=reward (the KL penalty rides on the task advantages)", cfg.kl.in_reward),
        ("shaping.overlong_buffer_len", sh.overlong_buffer_len is not None),
        ("shaping.reward_running_norm", sh.reward_running_norm), ("shaping.reward_clip", sh.reward_clip is not None),
        ("shaping.advantage_whiten", sh.advantage_whiten), ("shaping.advantage_clip", sh.advantage_clip is not None),
        ("shaping.clip_filter_like_weight", sh.clip_filter_like_weight),
        ("dynamic_sampling.enabled (it keeps groups by task-reward spread)", cfg.dynamic_sampling.enabled)) if on]
    if unused:
        return (f"teacher.use_task_rewards=false trains on the distillation signal alone (advantages = teacher.coef * "
                f"(log nu - log pi_old) per token), so {unused[0]} would act on task advantages that are not used: "
                "remove it (a KL to the reference goes in the loss: kl.mode=loss), or set teacher.use_task_rewards=true "
                "to add the signal to the task advantages")
    return None


def _token_budget_below_longest_sample(cfg: Any) -> str | None:
    """A micro-batch holds whole samples, so a token budget below the longest sample the run can
    make (``data.max_prompt_tokens`` + the response budget: ``rollout.agent.max_total_tokens``
    of a multi-turn rollout, else ``rollout.max_new_tokens``) would fail at that sample, after
    the rollout; verl asserts the same (``rearrange_micro_batches``: max_token_len >= the
    sequence length)."""
    agent = cfg.rollout.agent
    response_key, response = (("rollout.agent.max_total_tokens", agent.max_total_tokens) if agent is not None
                              else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens))
    longest = cfg.data.max_prompt_tokens + response
    for section in ("update", "critic", "logprobs"):
        budget = getattr(cfg, section).max_tokens_per_micro_batch
        if budget is not None and budget < longest:
            return (f"{section}.max_tokens_per_micro_batch={budget} is below the longest sample this run can make, "
                    f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + {response_key}={response} = {longest} "
                    f"tokens, and a micro-batch holds whole samples: set {section}.max_tokens_per_micro_batch >= "
                    f"{longest} (verl's ppo_max_token_len_per_gpu is usually 2-4x it), or lower those limits")
    return None


def _fsdp_with_deepspeed(cfg: Any) -> str | None:
    both = [s for s in ("update", "critic") if getattr(cfg, s).fsdp is not None and getattr(cfg, s).deepspeed is not None]
    if both:
        s = both[0]
        return (f"{s}.fsdp and {s}.deepspeed each shard the {'policy' if s == 'update' else 'critic'}'s parameters, "
                "gradients and AdamW state over the ranks, with their own process group, wrapping and checkpoint "
                f"format (FSDP2's torch.distributed.checkpoint shards, DeepSpeed's ZeRO partitions): keep one, remove "
                f"{s}.fsdp or {s}.deepspeed")
    return None


CONTRADICTIONS: tuple[Rule, ...] = (
    Rule("group-one-sample", ("advantage.estimator", "rollout.n_samples_per_prompt"), _group_one_sample),
    Rule("pass-at-k-beyond-group", ("advantage.k", "rollout.n_samples_per_prompt"), _pass_at_k_beyond_group),
    Rule("remax-with-agent", ("advantage.estimator", "rollout.agent"), _remax_with_agent),
    Rule("otb-without-actor-pass", ("advantage.estimator", "logprobs.recompute_old_logprobs"),
         _sum_pi_squared_without_actor),
    Rule("dppo-anchor-is-the-rollout", ("update.policy_loss.name", "logprobs.recompute_old_logprobs"), _dppo_anchor),
    Rule("gdpo-reward-weights", ("advantage.reward_weights", "reward.recipes"), _gdpo_reward_weights),
    Rule("gdpo-scalar-shaping", ("advantage.estimator", "shaping.overlong_buffer_len", "shaping.reward_running_norm",
                                 "shaping.reward_clip"), _gdpo_scalar_shaping),
    Rule("dynamic-one-sample", ("dynamic_sampling.enabled", "rollout.n_samples_per_prompt"), _dynamic_one_sample),
    Rule("train-batch-beyond-rollout", ("update.train_batch_size", "data.prompts_per_iteration",
                                        "rollout.n_samples_per_prompt"), _train_batch_beyond_rollout),
    Rule("adaptive-kl-from-zero", ("kl.controller", "kl.kl_coef"), _adaptive_kl_from_zero),
    Rule("overlong-buffer-too-long", ("shaping.overlong_buffer_len", "rollout.max_new_tokens"), _overlong_buffer_too_long),
    Rule("environment-without-agent", ("reward.sources", "rollout.agent"), _environment_without_agent),
    Rule("code-exec-without-tests", ("reward.sources", "data.task"), _code_exec_without_tests),
    Rule("dataset-grader-foreign-labels", ("reward.grader", "data.sources"), _dataset_grader_with_foreign_labels),
    Rule("staleness-untruncated-weights", ("rollout.max_staleness", "update.rollout_correction.mode"),
         _stale_untruncated_weights),
    Rule("partial-needs-staleness", ("rollout.partial.chunk_tokens", "rollout.max_staleness"), _partial_needs_staleness),
    Rule("partial-chunk-covers-response", ("rollout.partial.chunk_tokens", "rollout.max_new_tokens"),
         _partial_chunk_covers_response),
    Rule("partial-single-turn", ("rollout.partial", "rollout.agent", "dynamic_sampling.enabled", "advantage.estimator",
                                 "runners.rollout.shards"), _partial_single_turn),
    Rule("fsdp-with-deepspeed", ("update.fsdp", "update.deepspeed", "critic.fsdp", "critic.deepspeed"),
         _fsdp_with_deepspeed),
    Rule("token-budget-below-longest-sample", ("update.max_tokens_per_micro_batch", "critic.max_tokens_per_micro_batch",
                                               "logprobs.max_tokens_per_micro_batch", "data.max_prompt_tokens",
                                               "rollout.max_new_tokens", "rollout.agent.max_total_tokens"),
         _token_budget_below_longest_sample),
    Rule("distill-alone-task-settings", ("teacher.use_task_rewards", "advantage.estimator", "kl.mode", "shaping",
                                         "dynamic_sampling.enabled"), _distill_alone_task_settings),
)


def contradictions(cfg: Any) -> list[str]:
    """The messages of every rule in ``CONTRADICTIONS`` that ``cfg`` breaks, in table order."""
    return [msg for rule in CONTRADICTIONS if (msg := rule.check(cfg)) is not None]
