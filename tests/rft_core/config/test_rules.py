"""Settings that contradict each other are refused when the config loads, with one line that
names every key involved and the fix (rft_core/config/rules.py, docs/config.md): a case per
row of docs/config.md's table."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rft_core.config import CONTRADICTIONS, ConfigError, load_config

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"

# (rule, overrides on the default config, keys the message must name, the fix it must give)
CASES = [
    ("group-one-sample", {"rollout.n_samples_per_prompt": 1},
     ["advantage.estimator=grpo", "rollout.n_samples_per_prompt=1"], "advantage.estimator=reinforce"),
    ("group-one-sample", {"rollout.n_samples_per_prompt": 1, "advantage.estimator": "rloo"},
     ["advantage.estimator=rloo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt >= 2"),
    ("pass-at-k-beyond-group", {"advantage": {"estimator": "pass_at_k", "k": 8}},
     ["advantage.k=8", "rollout.n_samples_per_prompt=4"], "advantage.k <= 4"),
    ("remax-with-agent", {"advantage": "remax", "rollout.agent": {"environment": "calculator"}},
     ["advantage.estimator=remax", "rollout.agent"], "unset rollout.agent"),
    ("otb-without-actor-pass", {"advantage": "optimal_token_baseline", "logprobs.recompute_old_logprobs": False},
     ["advantage.estimator=optimal_token_baseline", "logprobs.recompute_old_logprobs=false"],
     "logprobs.recompute_old_logprobs=auto"),
    ("dppo-anchor-is-the-rollout", {"update.policy_loss": "dppo_tv", "update.epochs": 2},
     ["update.policy_loss.name=dppo_tv", "logprobs.recompute_old_logprobs=auto", "runs the actor pass here"],
     "set logprobs.recompute_old_logprobs=false"),
    ("dppo-anchor-is-the-rollout", {"update.policy_loss": "dppo_kl", "logprobs.recompute_old_logprobs": True},
     ["update.policy_loss.name=dppo_kl", "logprobs.recompute_old_logprobs=true"], "another policy loss (e.g. ppo_clip)"),
    ("gdpo-reward-weights", {"advantage": "gdpo"},
     ["advantage.estimator=gdpo", "advantage.reward_weights", "reward.recipes.default weighs format 0"],
     "set advantage.reward_weights (e.g. {correctness: 1, format: 0})"),
    ("gdpo-reward-weights", {"advantage": {"estimator": "gdpo", "reward_weights": {"acc": 1.0}}},
     ["advantage.reward_weights names ['acc']", "reward.sources", "defined: correctness, format"], "name defined sources"),
    ("gdpo-scalar-shaping", {"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0}},
                             "shaping.overlong_buffer_len": 16},
     ["advantage.estimator=gdpo", "shaping.overlong_buffer_len"], "unset shaping.overlong_buffer_len"),
    ("gdpo-scalar-shaping", {"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0}},
                             "shaping.reward_running_norm": True},
     ["advantage.estimator=gdpo", "shaping.reward_running_norm"], "choose another estimator"),
    ("dynamic-one-sample", {"rollout.n_samples_per_prompt": 1, "advantage": "reinforce", "dynamic_sampling.enabled": True},
     ["dynamic_sampling.enabled=true", "rollout.n_samples_per_prompt=1"], "dynamic_sampling.enabled=false"),
    ("train-batch-beyond-rollout", {"update.train_batch_size": 64, "data.prompts_per_iteration": 4},
     ["update.train_batch_size=64", "data.prompts_per_iteration", "rollout.n_samples_per_prompt", "4 x 4 = 16"],
     "update.train_batch_size <= 16"),
    ("adaptive-kl-from-zero", {"kl.controller": "adaptive", "kl.target": 6.0},
     ["kl.controller=adaptive", "kl.kl_coef=0"], "kl.kl_coef > 0"),
    ("overlong-buffer-too-long", {"shaping.overlong_buffer_len": 256, "rollout.max_new_tokens": 256},
     ["shaping.overlong_buffer_len=256", "rollout.max_new_tokens=256"], "shaping.overlong_buffer_len < rollout.max_new_tokens"),
    ("environment-without-agent", {"reward.sources": {"env": {"type": "environment"}}, "reward.recipes": {"default": [{"source": "env"}]},
                                   "reward.default_recipe": "default"},
     ["reward.sources.env.type=environment", "rollout.agent"], "set rollout.agent"),
    ("code-exec-without-tests", {"reward.sources": {"tests": "code_exec"}, "reward.recipes": {"default": [{"source": "tests"}]},
                                 "reward.default_recipe": "default"},
     ["reward.sources.tests.type=code_exec", "data.task=basic_arithmetic"], "data.task=humaneval"),
    ("dataset-grader-foreign-labels", {"data.source": "files", "data.sources": [{"path": "a.jsonl", "data_source": "openai/gsm8k"}]},
     ["reward.grader=dataset", "data.sources", "'openai/gsm8k'"], "reward.grader=math_verify"),
    ("dataset-grader-foreign-labels", {"data.source": "files", "data.sources": [{"path": "a.jsonl", "data_source": "mine"}],
                                       "reward.sources": {"ok": {"type": "math_answer", "grader": "dataset"}},
                                       "reward.recipes": {"default": [{"source": "ok"}]}, "reward.default_recipe": "default"},
     ["reward.sources.ok.grader=dataset", "data.sources", "'mine'"], "reward.sources.ok.grader=math_verify"),
    # the older cross-field checks, beside the fields they concern
    ("entropy-filter-needs-actor", {"update.entropy_top_fraction": 0.2, "logprobs.recompute_old_logprobs": False},
     ["update.entropy_top_fraction", "logprobs.recompute_old_logprobs"], "logprobs.recompute_old_logprobs=true"),
    ("correction-needs-actor", {"update.rollout_correction.enabled": True, "logprobs.recompute_old_logprobs": False},
     ["update.rollout_correction", "logprobs.recompute_old_logprobs"], "logprobs.recompute_old_logprobs=true"),
    ("micro-batch-beyond-train-batch", {"update.train_batch_size": 2, "update.micro_batch_size": 4},
     ["update.train_batch_size", "update.micro_batch_size"], ">="),
    ("checkpoint-every-needs-kept-policy", {"checkpoint.every": 3, "orchestration.keep_models": False},
     ["checkpoint.every=3", "orchestration.keep_models=false", "orchestration.workers=resident"], "checkpoint.every=1"),
    ("checkpoint-every-needs-kept-policy", {"checkpoint.every": 3, "rollout.max_staleness": 1},
     ["checkpoint.every=3", "rollout.max_staleness=1", "orchestration.workers=resident"], "checkpoint.every=1"),
    ("checkpoint-every-needs-kept-policy", {"checkpoint.every": 3, "update.lora": {}},
     ["checkpoint.every=3", "update.lora", "orchestration.workers=resident"], "checkpoint.every=1"),
    ("staleness-needs-actor", {"rollout.max_staleness": 1, "logprobs.recompute_old_logprobs": False},
     ["rollout.max_staleness=1", "logprobs.recompute_old_logprobs"], "recompute_old_logprobs=true"),
    ("staleness-needs-correction", {"rollout.max_staleness": 1, "update.rollout_correction.enabled": False},
     ["rollout.max_staleness=1", "update.rollout_correction.enabled=true"], "update.rollout_correction.enabled=true"),
    ("staleness-untruncated-weights", {"rollout.max_staleness": 1, "update.rollout_correction.mode": "seq-mask-tis"},
     ["rollout.max_staleness=1", "update.rollout_correction.mode=seq-mask-tis"],
     "update.rollout_correction.mode=tis with update.rollout_correction.rejection=seq_mean_k1 and rejection_cap=2"),
    ("cpgd-drift-needs-cpgd", {"update.cpgd_drift_coef": 0.1},
     ["update.cpgd_drift_coef", "update.policy_loss.name=cpgd"], "update.policy_loss.name=cpgd"),
    ("gspo-needs-sequence-mean", {"update.policy_loss": "gspo", "update.loss_agg": "token-mean"},
     ["'gspo'", "update.loss_agg='seq-mean-token-mean'"], "seq-mean-token-mean"),
    ("kl-loss-needs-gradient", {"kl.kl_coef": 0.1, "kl.mode": "loss", "kl.estimator": "k1"},
     ["k1", "kl.mode"], "k3+"),
    ("files-keys-need-files", {"data.path": "a.jsonl"},
     ["data.path", "data.source"], "data.source=files"),
    ("files-need-one-path", {"data.source": "files"},
     ["data.source=files", "data.path", "data.sources"], "exactly one"),
    ("agent-needs-hf", {"rollout.agent": {"environment": "calculator"}, "rollout.engine": "vllm"},
     ["rollout.agent", "rollout.engine=hf"], "rollout.first_token_temperature=null"),
    ("eval-sampling", {"eval.n_samples": 8, "eval.temperature": 0},
     ["eval.n_samples=8", "eval.temperature=0"], "eval.temperature > 0"),
    ("eval-sampling", {"eval.top_p": 0.95},
     ["eval.top_p=0.95", "eval.n_samples=1", "eval.temperature"], "unset eval.top_p"),
    ("shorthand-or-sources", {"reward.sources": {"f": "format"}, "reward.recipes": {"default": [{"source": "f"}]},
                              "reward.format_reward": 0.2},
     ["reward.grader/correct_reward/format_reward", "reward.sources"], "reward.recipes"),
    ("recipe-needs-source", {"reward.sources": {"f": "format"}, "reward.recipes": {"default": [{"source": "g"}]}},
     ["reward.recipes.default", "'g'", "reward.sources"], "defined: f"),
    ("resident-blockers", {"orchestration.workers": "resident", "rollout.engine": "vllm", "rollout.max_staleness": 2},
     ["orchestration.workers=resident", "rollout.max_staleness=2", "rollout.engine=vllm"], "hf engine"),
    ("resident-blockers", {"orchestration.workers": "resident", "runners.ppo_update.mode": "subprocess"},
     ["runners.ppo_update sets how ppo_update starts a process of its own", "orchestration.workers=resident"],
     "remove runners.ppo_update, or set orchestration.workers=stage"),
    ("resident-blockers", {"orchestration.workers": "resident", "update.deepspeed.zero_stage": 2, "update.lora": {},
                           "policy.dtype": "bfloat16"}, ["update.deepspeed with update.lora"], "DeepSpeed alone"),
    ("token-budget-below-longest-sample", {"update.max_tokens_per_micro_batch": 300, "rollout.max_new_tokens": 64},
     ["update.max_tokens_per_micro_batch=300", "data.max_prompt_tokens=256", "rollout.max_new_tokens=64", "= 320"],
     "set update.max_tokens_per_micro_batch >= 320"),
    ("token-budget-below-longest-sample", {"logprobs.max_tokens_per_micro_batch": 600, "data.max_prompt_tokens": 100,
                                           "rollout.agent": {"environment": "calculator"}},
     ["logprobs.max_tokens_per_micro_batch=600", "rollout.agent.max_total_tokens=512", "= 612"],
     "set logprobs.max_tokens_per_micro_batch >= 612"),
    # partial rollouts (issue 48)
    ("partial-needs-staleness", {"rollout.partial.chunk_tokens": 16},
     ["rollout.partial.chunk_tokens=16", "rollout.max_staleness=0"], "set rollout.max_staleness=1"),
    ("partial-chunk-covers-response", {"rollout.partial.chunk_tokens": 48, "rollout.max_new_tokens": 48,
                                       "rollout.max_staleness": 1},
     ["rollout.partial.chunk_tokens=48", "rollout.max_new_tokens=48"], "set rollout.partial.chunk_tokens < 48"),
    ("partial-single-turn", {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1,
                             "rollout.agent": {"environment": "calculator"}},
     ["rollout.partial", "rollout.agent"], "unset rollout.partial"),
    ("partial-single-turn", {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1,
                             "dynamic_sampling.enabled": True}, ["rollout.partial", "dynamic_sampling.enabled"],
     "remove that setting"),
    ("partial-single-turn", {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1, "advantage": "remax"},
     ["rollout.partial", "advantage.estimator=remax"], "unset rollout.partial"),
    ("partial-single-turn", {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1,
                             "runners.rollout.shards": 2}, ["rollout.partial", "runners.rollout.shards=2"],
     "unset rollout.partial"),
    ("fsdp-with-deepspeed", {"update.fsdp": {}, "update.deepspeed.zero_stage": 3},
     ["update.fsdp", "update.deepspeed"], "remove update.fsdp or update.deepspeed"),
    ("fsdp-with-deepspeed", {"critic.fsdp.cpu_offload": True, "critic.deepspeed": {}},
     ["critic.fsdp", "critic.deepspeed"], "remove critic.fsdp or critic.deepspeed"),
    # on-policy distillation (teacher)
    ("distill-alone-task-settings", {"teacher.path": "t", "teacher.use_task_rewards": False,
                                     "shaping.advantage_whiten": True},
     ["teacher.use_task_rewards=false", "shaping.advantage_whiten"], "set teacher.use_task_rewards=true"),
    ("distill-alone-task-settings", {"teacher.path": "t", "teacher.use_task_rewards": False, "advantage": "gae"},
     ["teacher.use_task_rewards=false", "advantage.estimator=gae (it needs a critic)"], "remove it"),
    ("distill-alone-task-settings", {"teacher.path": "t", "teacher.use_task_rewards": False, "kl.kl_coef": 0.1,
                                     "kl.mode": "reward"},
     ["teacher.use_task_rewards=false", "kl.mode=reward"], "kl.mode=loss"),
    ("teacher-needs-path", {"teacher.use_task_rewards": False},
     ["teacher.use_task_rewards", "teacher.path"], "set teacher.path"),
]


@pytest.mark.parametrize("rule, overrides, keys, fix", CASES, ids=[c[0] for c in CASES])
def test_a_contradiction_is_refused_at_load_naming_its_keys(rule, overrides, keys, fix):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    for key in keys + [fix]:
        assert key in message, (rule, key, message)


def test_every_rule_has_a_case_and_a_row_in_the_docs():
    table = DOCS.read_text()
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M))
    assert {r.name for r in CONTRADICTIONS} <= {c[0] for c in CASES}
    assert {c[0] for c in CASES} == rows


def test_the_defaults_and_every_preset_break_no_rule():
    load_config(None)
    for preset in sorted(Path("configs").glob("*.yaml")):
        load_config(preset)


def test_a_valid_neighbour_of_each_new_rule_loads():
    # one step back from each refusal: the same keys with the fix applied
    load_config(None, {"rollout.n_samples_per_prompt": 1, "advantage": "reinforce"})
    load_config(None, {"update.train_batch_size": 16, "data.prompts_per_iteration": 4})
    load_config(None, {"advantage": {"estimator": "pass_at_k", "k": 4}})
    load_config(None, {"advantage": "remax"})
    load_config(None, {"advantage": "optimal_token_baseline", "logprobs.recompute_old_logprobs": "auto"})
    load_config(None, {"kl.controller": "adaptive", "kl.target": 6.0, "kl.kl_coef": 0.05})
    load_config(None, {"shaping.overlong_buffer_len": 64, "rollout.max_new_tokens": 256})
    load_config(None, {"data.source": "files", "data.sources": [{"path": "a.jsonl", "data_source": "chain_sum"}]})
    load_config(None, {"data.source": "files", "data.sources": [{"path": "a.jsonl", "data_source": "mine"}],
                       "reward.grader": "math_verify"})
    load_config(None, {"reward.sources": {"tests": "code_exec"}, "reward.recipes": {"default": [{"source": "tests"}]},
                       "reward.default_recipe": "default", "data.task": "humaneval"})
    load_config(None, {"update.policy_loss": "dppo_tv", "update.epochs": 2, "logprobs.recompute_old_logprobs": False})
    load_config(None, {"update.policy_loss": "dppo_kl"})  # one step per rollout: auto runs no actor pass
    load_config(None, {"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0, "format": 0.0}}})
    load_config(None, {"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0}},
                       "shaping.advantage_whiten": True})  # advantage shaping acts on GDPO's advantages
    load_config(None, {"rollout.max_staleness": 1, "update.rollout_correction": {
        "mode": "tis", "rejection": "seq_mean_k1", "rejection_cap": 2.0}})
    load_config(None, {"update.rollout_correction.mode": "seq-mask-tis"})  # s = 0: the engine mismatch alone
    load_config(None, {"rollout.max_staleness": 1, "update.rollout_correction.mode": "sequence_mask"})  # docs/algorithms.md
    load_config(None, {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1})  # partial rollouts
    load_config(None, {"rollout.partial.chunk_tokens": 16, "rollout.max_staleness": 1,
                       "orchestration.workers": "resident"})  # resident workers continue the carry too
    # distillation alone needs no group: one sample per prompt loads, and so does the KL as a loss term
    load_config(None, {"teacher.path": "t", "teacher.use_task_rewards": False, "rollout.n_samples_per_prompt": 1})
    load_config(None, {"teacher.path": "t", "teacher.use_task_rewards": False, "kl.kl_coef": 0.1})
    load_config(None, {"teacher.path": "t", "shaping.advantage_whiten": True, "advantage": "gae"})  # with task rewards
    load_config(None, {"update.fsdp": {}, "critic.deepspeed": {}})  # FSDP2 for the policy, ZeRO for the critic
    # a resident FSDP2 LoRA trainer: adapters alone to a bfloat16 copy or an engine, merged on rank 0 in float32
    for extra in ({"policy.dtype": "bfloat16"}, {"policy.dtype": "bfloat16", "rollout.engine": "vllm"}, {},
                  {"policy.dtype": "auto", "rollout.engine": "sglang"}):
        load_config(None, {"orchestration.workers": "resident", "update.fsdp": {}, "update.lora": {}, **extra})
    load_config(None, {"update.max_tokens_per_micro_batch": 320, "rollout.max_new_tokens": 64,  # exactly the longest
                       "critic.max_tokens_per_micro_batch": 4096, "critic.packing": True})
    # stage mode keeping its models (the hf engine's default) keeps the policy between checkpoints
    assert load_config(None, {"checkpoint.every": 3}).orchestration.workers == "stage"


def test_a_bare_name_is_the_tagged_section_with_its_defaults():
    """`--set update.policy_loss=gspo`, as a verl or TRL user types it: GSPO with its paper's clip
    range and sequence-mean aggregation, not pydantic's 'Input should be a valid dictionary'."""
    from rft_core.config import GSPOLoss

    cfg = load_config("configs/grpo_demo.yaml", ["update.policy_loss=gspo", "advantage=rloo",
                                                 "reward.sources.fmt=format", "reward.recipes.default=[{source: fmt}]",
                                                 "reward.grader=dataset", "reward.format_reward=0.0",
                                                 "reward.default_recipe=default"])
    assert cfg.update.policy_loss == GSPOLoss() and cfg.update.loss_agg == "seq-mean-token-mean"
    assert cfg.advantage.estimator == "rloo" and cfg.reward.sources["fmt"].type == "format"
    # a bare name replaces the section: the preset's fields of another loss are not carried over
    assert load_config(None, {"update.policy_loss": {"name": "ppo_clip", "clip_high": 0.28}}).update.policy_loss.clip_high == 0.28
    assert load_config(None, [ "update.policy_loss.clip_high=0.28", "update.policy_loss=gspo"]).update.policy_loss == GSPOLoss()
