"""Config loading/overrides, deterministic prompt order, dataset errors, answer extraction and grading."""
from __future__ import annotations

import json

import pytest

from rft_core.config import ConfigError, TrainConfig, apply_overrides, load_config
from rft_core.data.prompts import DatasetError, build_prompts, iteration_indices
from rft_core.rewards.math import extract_answer, grade_math_verify, score_response


def test_presets_load(tmp_path):
    for name in ("grpo_demo", "grpo_gsm_symbolic"):
        cfg = load_config(f"configs/{name}.yaml")
        assert isinstance(cfg, TrainConfig) and cfg.name == name
    cfg = load_config("configs/grpo_demo.yaml", ["rollout.temperature=0.5", "data.task_config.max_terms=3", "kl.kl_coef=0"])
    assert cfg.rollout.temperature == 0.5 and not cfg.kl.needs_reference
    # a dotted override changes one key of a mapping and keeps the preset's others
    assert cfg.data.task_config["max_terms"] == 3 and cfg.data.task_config["min_terms"] == 2


@pytest.mark.parametrize("override, match", [
    (["advantage.estimator=gae_x"], r"advantage: unknown advantage estimator; valid names: grpo, group_norm, dr_grpo, "
                                     r"rloo, reinforce, reinforce_baseline, cpgd, gae\b.* \(got 'gae_x'\); write "
                                     r"advantage=NAME for its defaults, or advantage.estimator=NAME beside its fields"),
    (["update.policy_loss.name=ppo"], "unknown policy loss; valid names: ppo_clip, dual_clip, gspo, cpgd"),
    (["update.policy_loss=ppo"], r"update.policy_loss: unknown policy loss; valid names: ppo_clip, .* \(got 'ppo'\)"),
    (["update.policy_loss.name=dual_clip", "update.policy_loss.clip_c=1"], "clip_c"),
    (["critic.value_loss=huber"], "unknown value loss 'huber'; valid names: clipped_mse"),
    (["advantage.estimator=rloo", "advantage.scale_by_std=false"], r"advantage.scale_by_std \(in estimator=rloo\): not a setting; valid keys here: estimator$"),
    (["kl.estimator=k4"], r"unknown KL estimator 'k4'; valid names: .*k1, k1\+, k2, k3, k3\+, low_var_kl, low_var_kl\+, mse"),
    (["update.loss_agg=sum"], "valid names: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"),
    (["rollout.temprature=1"], "rollout.temprature: not a setting; valid keys here: engine, n_samples_per_prompt, temperature, "),
    (["rollout.temperature=-1"], "rollout.temperature"),
    (["rollout"], "must look like key.sub=value"),
])
def test_bad_config_names_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, override)


def test_bad_file_and_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_apply_overrides_parses_yaml_values():
    out = apply_overrides({"a": {"b": 1}}, ["a.c=0.5", "a.d=true", "e=[1, 2]", "f.g=text"])
    assert out == {"a": {"b": 1, "c": 0.5, "d": True}, "e": [1, 2], "f": {"g": "text"}}
    with pytest.raises(ConfigError, match="'a' is not a section"):
        apply_overrides({"a": 3}, ["a.b=1"])


def test_iteration_indices_deterministic_and_cover_epoch():
    a = iteration_indices(3, per_iteration=4, size=10, seed=7)
    assert a == iteration_indices(3, per_iteration=4, size=10, seed=7)
    first_epoch = iteration_indices(1, per_iteration=5, size=10, seed=7) + iteration_indices(2, per_iteration=5, size=10, seed=7)
    assert sorted(first_epoch) == list(range(10))  # an epoch visits every prompt once
    assert iteration_indices(3, per_iteration=5, size=10, seed=7) != iteration_indices(1, per_iteration=5, size=10, seed=7)
    with pytest.raises(ValueError, match="1-based"):
        iteration_indices(0, per_iteration=1, size=1, seed=0)


class _Tok:
    """Minimal tokenizer: one token per character."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_build_prompts_skips_overlong_and_rejects_bad_rows():
    entries = [(0, {"question": "1+1?", "answer": "2", "metadata": {"k": 1}}), (1, {"question": "x" * 500, "answer": "1"})]
    batch = build_prompts(entries, _Tok(), data_source="t", system_prompt="", max_prompt_tokens=100)
    assert batch.table.column("prompt_id").to_pylist() == ["t-000000"] and batch.skipped_overlong == ["t-000001"]
    assert json.loads(batch.table.column("metadata_json")[0].as_py()) == {"k": 1}
    assert batch.table.column("prompt_token_ids")[0].as_py() == [ord(c) for c in "<user>1+1?<assistant>"]
    # len("<user>") + 500 + len("<assistant>") = 6 + 500 + 11 = 517
    with pytest.raises(DatasetError, match="t-000001: prompt has 517 tokens"):
        build_prompts(entries, _Tok(), data_source="t", system_prompt="", max_prompt_tokens=100, overlong="error")
    with pytest.raises(DatasetError, match=r"row 5: missing field\(s\) \['answer'\]"):
        build_prompts([(5, {"question": "q"})], _Tok(), data_source="t", system_prompt="", max_prompt_tokens=100)


@pytest.mark.parametrize("text, answer, formatted", [
    ("so it is 12\nAnswer: 12", "12", True),
    ("<answer> -4 </answer> and later 7", "-4", True),
    ("**Answer:** 3.5.", "3.5", True),
    ("first 3 then 1,234", "1234", False),
    ("no number here", None, False),
])
def test_extract_answer(text, answer, formatted):
    assert extract_answer(text) == (answer, formatted)


def test_score_with_reasoning_gym_grader():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=3)
    e = ds[0]
    kw = dict(source="basic_arithmetic", question=e["question"], label=e["answer"], metadata_json=json.dumps(e["metadata"]))
    right = score_response(f"Let me compute.\nAnswer: {e['answer']}", format_reward=0.1, **kw)
    assert right.correct and right.reward == pytest.approx(1.1) and right.metrics == {"correctness": 1.0, "format": 1.0}
    # the first number of the text is not the answer: extraction must pick the last one
    bare = score_response(f"{int(e['answer']) + 1} is wrong, it is {e['answer']}", format_reward=0.1, **kw)
    assert bare.correct and bare.reward == pytest.approx(1.0)
    wrong = score_response(f"Answer: {int(e['answer']) + 1}", format_reward=0.1, **kw)
    assert not wrong.correct and wrong.reward == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown grader"):
        score_response("1", grader="nope", **kw)


def test_math_verify_off_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:  # signal.alarm would fail here without timeout=None
        assert ex.submit(grade_math_verify, "\\frac{1}{2}", label="0.5").result() == 1.0
        assert ex.submit(grade_math_verify, "0.4", label="0.5").result() == 0.0


def test_each_estimator_config_matches_its_function_kwargs():
    import inspect

    from rft_core.algorithms import ADVANTAGE_ESTIMATORS
    from rft_core.config import ADVANTAGE_CONFIGS

    tensor_inputs = {"token_rewards", "values", "reward_baselines", "old_logprobs", "sum_pi_squared", "rollout_is_weights",
                     "source_rewards"}  # data, not settings (gdpo: each reward source's scores)
    covered = set()
    for cls in ADVANTAGE_CONFIGS:
        names = cls.model_fields["estimator"].annotation.__args__
        fields = set(cls.model_fields) - {"estimator"}
        for name in names:
            params = inspect.signature(ADVANTAGE_ESTIMATORS[name]).parameters
            kw_only = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY} - tensor_inputs
            assert fields == kw_only, (name, fields, kw_only)
            covered.add(name)
    assert covered == set(ADVANTAGE_ESTIMATORS.names())  # every registered estimator has a config


def test_estimator_config_chosen_by_name():
    from rft_core.config import ReinforceAdvantage, estimator_kwargs

    cfg = load_config(None, ["advantage.estimator=reinforce", "advantage.gamma=0.9"])
    assert isinstance(cfg.advantage, ReinforceAdvantage)
    assert estimator_kwargs(cfg.advantage) == {"gamma": 0.9, "whiten": True, "eps": 1e-8}


def test_each_policy_loss_config_matches_its_function_kwargs():
    import inspect

    from rft_core.algorithms import POLICY_LOSSES
    from rft_core.config import POLICY_LOSS_CONFIGS, policy_loss_kwargs

    names = set()
    for cls in POLICY_LOSS_CONFIGS:
        for name in cls.model_fields["name"].annotation.__args__:  # a config's aliases (gmpo, geo_mean)
            params = inspect.signature(POLICY_LOSSES[name]).parameters
            kw_only = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
            assert set(policy_loss_kwargs(cls())) == kw_only, name
            # the config's defaults are the function's defaults
            assert all(params[k].default == v for k, v in policy_loss_kwargs(cls()).items()), name
            names.add(name)
    assert names == set(POLICY_LOSSES.names())
    cfg = load_config(None, ["update.policy_loss.clip_high=0.28"])
    assert cfg.update.policy_loss.name == "ppo_clip" and cfg.update.policy_loss.clip_high == 0.28


def test_run_root_placeholders_resolved(tmp_path, monkeypatch):
    import datetime as dt

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["name=exp", "run_root=runs/{name}-{timestamp}"]).with_resolved_run_root(dt.datetime(2026, 1, 2, 3, 4, 5))
    assert cfg.run_root == str(tmp_path / "runs" / "exp-20260102-030405")
    remote = load_config(None, ["run_root=s3://bucket/{name}"]).with_resolved_run_root()
    assert remote.run_root == "s3://bucket/grpo"  # URIs are left as they are, only filled in


# ---------------------------------------------------------------- issue 16: defaults that follow the papers
@pytest.mark.parametrize("estimator, mode, kl_estimator", [
    ("grpo", "loss", "k3+"), ("group_norm", "loss", "k3+"), ("dr_grpo", "loss", "k3+"), ("cpgd", "loss", "k3+"),
    ("rloo", "reward", "k1"), ("reinforce", "reward", "k1"), ("reinforce_baseline", "reward", "k1"), ("gae", "reward", "k1"),
])
def test_kl_mode_and_estimator_default_to_the_estimators_paper(estimator, mode, kl_estimator):
    cfg = load_config(None, {"advantage.estimator": estimator, "kl.kl_coef": 0.1})
    assert (cfg.kl.mode, cfg.kl.estimator) == (mode, kl_estimator)
    # an explicit mode wins; the estimator follows the mode unless given
    other = "reward" if mode == "loss" else "loss"
    cfg = load_config(None, {"advantage.estimator": estimator, "kl.kl_coef": 0.1, "kl.mode": other})
    assert (cfg.kl.mode, cfg.kl.estimator) == (other, {"loss": "k3+", "reward": "k1"}[other])
    cfg = load_config(None, {"advantage.estimator": estimator, "kl.kl_coef": 0.1, "kl.mode": other, "kl.estimator": "k2"})
    assert (cfg.kl.mode, cfg.kl.estimator) == (other, "k2")


def test_kl_default_also_fills_in_config_models_given_as_objects():
    from rft_core.config import KLConfig, RLOOAdvantage

    cfg = TrainConfig(kl=KLConfig(kl_coef=0.1), advantage=RLOOAdvantage())
    assert (cfg.kl.mode, cfg.kl.estimator, cfg.kl.kl_coef) == ("reward", "k1", 0.1)
    cfg = TrainConfig(kl=KLConfig(kl_coef=0.1, mode="loss", estimator="k2"), advantage=RLOOAdvantage())
    assert (cfg.kl.mode, cfg.kl.estimator) == ("loss", "k2")


def test_k1_as_a_loss_term_is_refused_naming_the_alternatives():
    with pytest.raises(ConfigError, match=r"'k1' has zero expected gradient as a loss term.*grad KL\(pi\|\|ref\) use one "
                                          r"of abs\+, k1\+, k2, k3\+, low_var_kl\+, mse; for grad KL\(ref\|\|pi\): k3, low_var_kl"
                                          r".*loss for grpo"):
        load_config(None, {"kl.kl_coef": 0.01, "kl.estimator": "k1"})  # grpo: kl.mode defaults to loss
    with pytest.raises(ConfigError, match="zero expected gradient"):
        load_config(None, {"kl.kl_coef": 0.01, "kl.estimator": "k1", "kl.mode": "loss"})
    # allowed where it means something: in the reward, or with no KL at all
    assert load_config(None, {"kl.kl_coef": 0.01, "kl.estimator": "k1", "kl.mode": "reward"}).kl.in_reward
    assert not load_config(None, {"kl.kl_coef": 0.0, "kl.estimator": "k1"}).kl.in_loss
    for name in ("k2", "k3", "k1+", "k3+", "low_var_kl+"):
        assert load_config(None, {"kl.kl_coef": 0.01, "kl.estimator": name}).kl.in_loss


def test_gspo_is_always_sequence_level():
    cfg = load_config(None, {"update.policy_loss.name": "gspo"})
    assert cfg.update.loss_agg == "seq-mean-token-mean"  # set when left out
    with pytest.raises(ConfigError, match=r"policy loss 'gspo' needs update.loss_agg='seq-mean-token-mean', got "
                                          r"'token-mean': GSPO's objective is sequence-level"):
        load_config(None, {"update.policy_loss.name": "gspo", "update.loss_agg": "token-mean"})
    assert load_config(None, {"update.loss_agg": "seq-mean-token-sum"}).update.loss_agg == "seq-mean-token-sum"


def test_seq_mean_token_sum_norm_is_normalised_by_the_generation_budget():
    cfg = load_config(None, {"update.loss_agg": "seq-mean-token-sum-norm", "rollout.max_new_tokens": 77})
    assert cfg.update.loss_norm_tokens == 77
    cfg = load_config(None, {"update.loss_agg": "seq-mean-token-sum-norm", "update.loss_norm_tokens": 500})
    assert cfg.update.loss_norm_tokens == 500
    assert load_config(None, {"rollout.max_new_tokens": 77}).update.loss_norm_tokens is None  # other aggregations


@pytest.mark.parametrize("overrides, enabled", [
    ({}, False),  # hf engine, top_p 1, actor stage: the ratio old/rollout is 1 up to float rounding
    ({"rollout.top_p": 0.9}, True),
    ({"rollout.first_token_temperature": 2.0}, True),
    ({"rollout.engine": "vllm"}, True),
    ({"rollout.engine": "vllm", "logprobs.recompute_old_logprobs": False}, False),  # old = rollout: ratio 1
    ({"rollout.top_p": 0.9, "update.rollout_correction.enabled": False}, False),  # explicit wins
    ({"update.rollout_correction.enabled": True}, True),
])
def test_rollout_correction_is_on_where_the_engine_samples_another_distribution(overrides, enabled):
    rc = load_config(None, overrides).update.rollout_correction
    assert rc.enabled is enabled and (rc.mode, rc.cap, rc.low) == ("tis", 2.0, None)


@pytest.mark.parametrize("overrides, match", [
    ({"update.rollout_correction.enabled": True, "logprobs.recompute_old_logprobs": False},
     "rollout_correction weights pi_old / pi_rollout with the trainer's old log-probs: set logprobs.recompute_old_logprobs=true"),
    ({"update.rollout_correction.mode": "tis2"}, "unknown rollout correction mode 'tis2'; valid names: geo-tis, icepop, none, seq-mask-tis, seq-tis, sequence_mask, tis"),
    ({"update.rollout_correction.low": 2.0}, r"low \(2.0\) must be below cap \(2.0\)"),
    ({"update.cpgd_drift_coef": 0.1}, "cpgd_drift_coef is CPGD's policy-drift term .* needs update.policy_loss.name=cpgd"),
    ({"update.entropy_filter_norm": "some"}, "update.entropy_filter_norm"),
])
def test_rl_math_options_refuse_what_they_cannot_do(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_update_defaults_dropout_off_and_full_count_entropy_normaliser():
    u = load_config(None, {"update.policy_loss.name": "cpgd", "update.cpgd_drift_coef": 0.5}).update
    assert (u.dropout, u.entropy_filter_norm, u.cpgd_drift_coef) == (False, "all", 0.5)
    assert load_config(None, {"shaping.overlong_filter": True}).shaping.overlong_filter


@pytest.mark.parametrize("name", ["grpo_demo", "grpo_gsm_symbolic", "grpo_humaneval", "grpo_judge", "grpo_learning",
                                  "grpo_my_data", "grpo_scale", "grpo_vl_digits"])
def test_presets_load_with_a_kl_that_has_a_gradient(name):
    from rft_core.algorithms import KL_ESTIMATORS
    from rft_core.algorithms.kl import GRAD_ZERO

    for path in [f"configs/{name}.yaml"]:
        cfg = load_config(path)
        if cfg.kl.in_loss:
            assert KL_ESTIMATORS.info(cfg.kl.estimator).loss_gradient != GRAD_ZERO, path
    demo = load_config("configs/grpo_demo.yaml")
    assert (demo.kl.mode, demo.kl.estimator, demo.kl.kl_coef) == ("loss", "k3+", 0.01)


@pytest.mark.parametrize("overrides, recomputes, reason", [
    ({}, False, None),  # hf engine, float32, top-p 1, one optimizer step: the engine's log-probs are pi_old's
    ({"rollout.engine": "vllm"}, True, "rollout.engine=vllm"),
    ({"rollout.top_p": 0.9}, True, "processed distribution"),
    ({"rollout.first_token_temperature": 2.0}, True, "processed distribution"),
    ({"policy.dtype": "bfloat16"}, True, "policy.dtype=bfloat16"),
    ({"policy.dtype": "auto"}, True, "policy.dtype=auto"),
    ({"update.epochs": 2}, True, "more than one optimizer step"),
    ({"update.train_batch_size": 16}, True, "more than one optimizer step"),  # 8 prompts x 4 samples = 32 > 16
    ({"update.train_batch_size": 32}, False, None),  # the whole rollout in one step
    ({"update.entropy_top_fraction": 0.2}, True, "entropy_top_fraction"),
    ({"update.rollout_correction.enabled": True}, True, "rollout_correction"),
    ({"rollout.agent": {"environment": "calculator"}}, True, "multi-turn"),
    ({"logprobs.recompute_old_logprobs": True}, True, None),  # explicit wins
    ({"logprobs.recompute_old_logprobs": False, "update.epochs": 2}, False, "more than one optimizer step"),
])
def test_auto_recomputes_old_logprobs_only_where_the_engine_is_not_pi_old(overrides, recomputes, reason):
    cfg = load_config(None, {"data.prompts_per_iteration": 8, "rollout.n_samples_per_prompt": 4, **overrides})
    assert cfg.recomputes_old_logprobs is recomputes
    blockers = cfg.old_logprobs_blockers()
    assert (not blockers) if reason is None else any(reason in b for b in blockers), blockers


def test_auto_old_logprobs_is_the_default_and_parses_from_overrides():
    assert load_config(None).logprobs.recompute_old_logprobs == "auto"
    assert load_config(None, ["logprobs.recompute_old_logprobs=false"]).logprobs.recompute_old_logprobs is False
    assert load_config(None, ["logprobs.recompute_old_logprobs=auto"]).logprobs.recompute_old_logprobs == "auto"
    with pytest.raises(ConfigError, match="logprobs.recompute_old_logprobs"):
        load_config(None, ["logprobs.recompute_old_logprobs=sometimes"])
