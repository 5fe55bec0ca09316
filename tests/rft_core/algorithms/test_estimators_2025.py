"""Issue 29's added estimators: pass@k (Chen et al. 2025), OPO (Hao et al. 2025), ReMax (Li et al.
2023) with its greedy baseline through the rollout, rewards and advantages stages, verl's optimal
token baseline (function only) and verl's ``abs`` KL estimator.

Each is checked three ways: against a plain-Python float64 loop of the paper's equations (for
pass@k, the combinatorial definition it is derived from), against hand-computed small cases, and
against the numbers upstream's own function produced (``data/verl_estimators.json``, written by
``benchmarks/verl_fixtures/make_estimator_fixtures.py`` from verl's ``core_algos.py`` and the
Pass@k Training authors' ``passk_adv.py``; commits recorded in the file)."""
from __future__ import annotations

import itertools
import json
import math
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rft_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, kl_penalty
from rft_core.algorithms.baselines import optimal_token_baseline_advantages
from rft_core.algorithms.kl import GRAD_L1, check_kl_loss_estimator
from rft_core.config import ConfigError, GRPOAdvantage, KLConfig, ShapingConfig, TrainState, estimator_kwargs, load_config

D = torch.float64
DATA = json.loads((Path(__file__).parent / "data" / "verl_estimators.json").read_text())


def _mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(T)] for n in lengths])


def _groups(names: list[str]) -> torch.Tensor:
    order = {g: i for i, g in enumerate(dict.fromkeys(names))}
    return torch.tensor([order[g] for g in names])


# ------------------------------------------------------------------------------------- pass@k
def _pass_at_k_by_subsets(rewards: list[int], k: int, eps: float) -> list[float]:
    """The definition the closed form is derived from: every k-subset of the group is rewarded
    max(its rewards); its advantage is (R_S - mean) / (std + eps) over all C(n, k) subsets
    (population std); a response's advantage is the mean over the subsets that contain it."""
    n = len(rewards)
    subsets = list(itertools.combinations(range(n), k))
    r = {s: float(max(rewards[i] for i in s)) for s in subsets}
    mean = sum(r.values()) / len(r)
    std = math.sqrt(sum((v - mean) ** 2 for v in r.values()) / len(r))
    return [sum((r[s] - mean) / (std + eps) for s in subsets if i in s) / sum(1 for s in subsets if i in s)
            for i in range(n)]


@pytest.mark.parametrize("rewards,k", [
    ([1, 0, 0, 0], 2), ([1, 0, 1, 0, 0, 1, 0], 3), ([0, 1, 1, 0, 0, 0], 1), ([1, 0, 0, 1, 0, 0, 0, 1], 4),
    ([1, 1, 1, 0, 1], 2), ([0, 0, 0, 0], 2), ([1, 1, 1], 2), ([1, 0, 0], 3), ([0, 1, 0, 0, 0, 0, 0, 0, 0, 0], 5),
])
def test_pass_at_k_closed_form_equals_the_subset_definition(rewards, k):
    eps = 1e-6
    want = _pass_at_k_by_subsets(rewards, k, eps)
    r = torch.tensor(rewards, dtype=D)
    mask = _mask([2] * len(rewards), 3)
    adv, ret = ADVANTAGE_ESTIMATORS["pass_at_k"](r, torch.zeros(len(rewards), dtype=torch.long), mask, k=k, eps=eps)
    assert adv.dtype == D
    torch.testing.assert_close(adv[:, 0], torch.tensor(want, dtype=D), rtol=0, atol=1e-12)
    assert (adv[:, 2] == 0).all() and (adv[:, 0] == adv[:, 1]).all()  # broadcast over the response, 0 when masked
    torch.testing.assert_close(ret[:, 0], r, rtol=0, atol=0)


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: mean = 1 - C(3,2)/C(4,2) = 1/2, std = 1/2; A_pos = (1 - 1/2)/(1/2) = 1;
    # A_neg = (1 - 1/2 - C(2,1)/C(3,1)) / (1/2) = (1/2 - 2/3) * 2 = -1/3
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv, _ = ADVANTAGE_ESTIMATORS["pass_at_k"](torch.tensor([1.0, 0, 0, 0], dtype=D), torch.zeros(4, dtype=torch.long),
                                               mask, k=2, eps=0.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=D), rtol=0, atol=1e-15)
    # n=5, c=2, k=3: mean = 1 - C(3,3)/C(5,3) = 9/10, std = 3/10; A_pos = (1/10)/(3/10) = 1/3;
    # A_neg = (1/10 - C(2,2)/C(4,2)) / (3/10) = (1/10 - 1/6) * 10/3 = -2/9
    adv, _ = ADVANTAGE_ESTIMATORS["pass_at_k"](torch.tensor([0.0, 1, 0, 1, 0], dtype=D), torch.zeros(5, dtype=torch.long),
                                               torch.ones(5, 1, dtype=torch.bool), k=3, eps=0.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-2 / 9, 1 / 3, -2 / 9, 1 / 3, -2 / 9], dtype=D), rtol=0, atol=1e-15)


def test_pass_at_k_with_k_1_is_grpo_with_the_population_std():
    r = torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0, 1, 0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    mask = torch.ones(10, 2, dtype=torch.bool)
    adv, _ = ADVANTAGE_ESTIMATORS["pass_at_k"](r, groups, mask, k=1, eps=1e-6)
    grpo_pop = torch.cat([(g - g.mean()) / (g.std(unbiased=False) + 1e-6) for g in (r[:5], r[5:])])
    torch.testing.assert_close(adv[:, 0], grpo_pop, rtol=0, atol=1e-12)


def test_pass_at_k_refuses_k_beyond_a_group_and_non_binary_rewards():
    mask = torch.ones(5, 1, dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 1, 1])
    r = torch.tensor([1.0, 0, 0, 1, 0])
    with pytest.raises(ValueError, match=r"advantage.k=3 exceeds the group size 2 .*between 1 and the group size"):
        ADVANTAGE_ESTIMATORS["pass_at_k"](r, groups, mask, k=3)
    with pytest.raises(ValueError, match="must be >= 1"):
        ADVANTAGE_ESTIMATORS["pass_at_k"](r, groups, mask, k=0)
    with pytest.raises(ValueError, match=r"binary rewards .*0.5"):
        ADVANTAGE_ESTIMATORS["pass_at_k"](torch.tensor([1.0, 0.5, 0, 1, 0]), groups, mask, k=2)


def test_pass_at_k_matches_the_authors_code():
    for case in DATA["pass_at_k"]:
        n = len(case["rewards"])
        adv, _ = ADVANTAGE_ESTIMATORS["pass_at_k"](torch.tensor(case["rewards"], dtype=D), _groups(case["group"]),
                                                   torch.ones(n, 1, dtype=torch.bool), k=case["k"])
        torch.testing.assert_close(adv[:, 0], torch.tensor(case["advantages"], dtype=D), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------- OPO
def _opo_loop(rewards: list[float], groups: list[str], lengths: list[int]) -> list[float]:
    out = []
    for r, g in zip(rewards, groups):
        members = [i for i, h in enumerate(groups) if h == g]
        num = sum(lengths[i] * rewards[i] for i in members)
        den = sum(lengths[i] for i in members)
        out.append(r - num / den)
    return out


def test_opo_against_the_loop_and_by_hand():
    rewards, groups, lengths = [1.0, 0.0, 0.5, 0.25, 1.0, 0.0], ["a", "a", "a", "b", "b", "c"], [2, 6, 4, 1, 3, 5]
    mask = _mask(lengths, 7)
    adv, ret = ADVANTAGE_ESTIMATORS["opo"](torch.tensor(rewards, dtype=D), _groups(groups), mask)
    want = torch.tensor(_opo_loop(rewards, groups, lengths), dtype=D)
    torch.testing.assert_close(adv, torch.where(mask, want[:, None], torch.zeros((), dtype=D)), rtol=0, atol=1e-15)
    # group a by hand: b = (2*1 + 6*0 + 4*0.5) / 12 = 1/3; group c (one sample): b = r, A = 0
    torch.testing.assert_close(adv[:3, 0], torch.tensor([2 / 3, -1 / 3, 1 / 6], dtype=D), rtol=0, atol=1e-15)
    assert (adv[5] == 0).all()
    torch.testing.assert_close(ret[:, 0], torch.tensor(rewards, dtype=D), rtol=0, atol=0)


def test_opo_matches_verl():
    for case in DATA["opo"]:
        mask = _mask(case["lengths"], case["T"])
        adv, _ = ADVANTAGE_ESTIMATORS["opo"](torch.tensor(case["rewards"], dtype=D), _groups(case["group"]), mask)
        torch.testing.assert_close(adv, torch.tensor(case["advantages"], dtype=D), rtol=0, atol=1e-14)


# --------------------------------------------------------------------------------------- ReMax
def test_remax_against_the_loop_and_verl():
    for case in DATA["remax"]:
        mask = _mask(case["lengths"], case["T"])
        tr = torch.tensor(case["token_rewards"], dtype=D)
        b = torch.tensor(case["reward_baselines"], dtype=D)
        r = torch.tensor(case["rewards"], dtype=D)
        adv, ret = ADVANTAGE_ESTIMATORS["remax"](r, torch.arange(len(r)), mask, reward_baselines=b, token_rewards=tr)
        loop = [[sum(tr[i, k].item() for k in range(t, case["lengths"][i])) - b[i].item() if t < case["lengths"][i] else 0.0
                 for t in range(case["T"])] for i in range(len(r))]
        torch.testing.assert_close(adv, torch.tensor(loop, dtype=D), rtol=0, atol=1e-14)
        torch.testing.assert_close(adv, torch.tensor(case["advantages"], dtype=D), rtol=0, atol=1e-14)
        torch.testing.assert_close(ret, torch.tensor(case["returns"], dtype=D), rtol=0, atol=1e-14)
    # outcome rewards only: r_i - r(greedy_i) on every response token
    mask = _mask([2, 3], 3)
    adv, _ = ADVANTAGE_ESTIMATORS["remax"](torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 0]), mask,
                                           reward_baselines=torch.tensor([0.25, 0.5], dtype=D))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0], [-0.5, -0.5, -0.5]], dtype=D), rtol=0, atol=0)
    with pytest.raises(ValueError, match="reward_baselines must have the rewards' shape"):
        ADVANTAGE_ESTIMATORS["remax"](torch.zeros(2), torch.tensor([0, 0]), mask, reward_baselines=torch.zeros(3))


def _batch(rewards, lengths, prompt_ids):
    from schemas.batch import ColumnBatch

    B, T = len(rewards), max(lengths)
    mask = _mask(lengths, T)
    z = torch.zeros(B, T)
    return ColumnBatch(sample_id=[f"s{i}" for i in range(B)], prompt_id=prompt_ids, finish_reason=["stop"] * B,
                       prompt_token_ids=torch.ones(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                       response_token_ids=torch.ones(B, T, dtype=torch.long), response_mask=mask.long(),
                       action_mask=mask, response_length=torch.tensor(lengths), rollout_logprobs=z, old_logprobs=z,
                       rewards=torch.tensor(rewards))


def test_remax_in_compute_advantages_shapes_the_baseline_like_the_rewards():
    from rft_core.algorithms.shaping import RunningMoments
    from rft_core.config import ReMaxAdvantage
    from rft_core.stages.advantages import compute_advantages

    batch = _batch([1.0, 0.0, 1.0], [2, 3, 1], ["a", "a", "b"])
    base = (torch.tensor([0.0, 0.0, 1.0]), torch.tensor([4, 4, 1]))
    kl = KLConfig(kl_coef=0.0, mode="reward", estimator="k1")
    res = compute_advantages(batch, kl_cfg=kl, adv_cfg=ReMaxAdvantage(), greedy_baseline=base)
    torch.testing.assert_close(res["advantages"], torch.tensor([[1.0, 1.0, 0], [0, 0, 0], [0, 0, 0]]) * batch.action_mask,
                               rtol=0, atol=0)
    assert res["metrics"]["greedy_baseline_reward_mean"] == pytest.approx(1 / 3)
    # running normalisation: the baseline is normalised with the statistics of the sampled rewards
    res = compute_advantages(batch, kl_cfg=kl, adv_cfg=ReMaxAdvantage(), greedy_baseline=base,
                             shaping=ShapingConfig(reward_running_norm=True))
    std = RunningMoments(0, 0.0, 0.0).update(torch.tensor([1.0, 0.0, 1.0])).std
    torch.testing.assert_close(res["advantages"][:, 0], torch.tensor([1.0, 0.0, 0.0]) / (std + 1e-8), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="needs the reward of a greedy response"):
        compute_advantages(batch, kl_cfg=kl, adv_cfg=ReMaxAdvantage())
    # estimators without a greedy baseline ignore one
    plain = compute_advantages(batch, kl_cfg=kl, adv_cfg=GRPOAdvantage())
    torch.testing.assert_close(compute_advantages(batch, kl_cfg=kl, adv_cfg=GRPOAdvantage(), greedy_baseline=base)[
        "advantages"], plain["advantages"], rtol=0, atol=0)


# ------------------------------------------------------------------------ optimal token baseline
def _otb_loop(tr, mask, groups, old_lp, spi2, is_w, eps=1e-8):
    B, T = len(tr), len(tr[0])
    G = [[sum(tr[i][k] for k in range(t, T) if mask[i][k]) if mask[i][t] else 0.0 for t in range(T)] for i in range(B)]
    W = []
    for i in range(B):
        acc, row = 0.0, []
        for t in range(T):
            if mask[i][t]:
                w = 1 - 2 * math.exp(old_lp[i][t]) + spi2[i][t]
                acc += w * (is_w[i][t] ** 2 if is_w is not None else 1.0)
            row.append(acc)
        W.append(row)
    adv = []
    for i in range(B):
        members = [j for j in range(B) if groups[j] == groups[i]]
        row = []
        for t in range(T):
            if not mask[i][t]:
                row.append(0.0)
                continue
            if len(members) == 1:
                b = 0.0
            else:
                b = sum(G[j][t] * W[j][t] for j in members if mask[j][t]) / (
                    sum(W[j][t] for j in members if mask[j][t]) + eps)
            row.append(G[i][t] - b)
        adv.append(row)
    return adv, G


def test_optimal_token_baseline_against_the_loop_and_verl():
    for case in DATA["optimal_token_baseline"]:
        mask = _mask(case["lengths"], case["T"])
        r = torch.tensor(case["rewards"], dtype=D)
        lp, spi2 = torch.tensor(case["old_logprobs"], dtype=D), torch.tensor(case["sum_pi_squared"], dtype=D)
        w = None if case["rollout_is_weights"] is None else torch.tensor(case["rollout_is_weights"], dtype=D)
        # verl b178a3cd's default handle_zero_tail=False (True since verl PR #5380: test_estimators_2026.py)
        adv, ret = optimal_token_baseline_advantages(r, _groups(case["group"]), mask, old_logprobs=lp, sum_pi_squared=spi2,
                                                     rollout_is_weights=w, handle_zero_tail=False)
        tr = [[(case["rewards"][i] if t == n - 1 else 0.0) for t in range(case["T"])] for i, n in enumerate(case["lengths"])]
        loop_adv, loop_ret = _otb_loop(tr, mask.tolist(), case["group"], case["old_logprobs"], case["sum_pi_squared"],
                                       case["rollout_is_weights"])
        torch.testing.assert_close(adv, torch.tensor(loop_adv, dtype=D), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, torch.tensor(loop_ret, dtype=D), rtol=0, atol=1e-12)
        torch.testing.assert_close(adv, torch.tensor(case["advantages"], dtype=D), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, torch.tensor(case["returns"], dtype=D), rtol=0, atol=1e-12)
    assert ADVANTAGE_ESTIMATORS["optimal_token_baseline"] is optimal_token_baseline_advantages
    assert ADVANTAGE_ESTIMATORS.info("optimal_token_baseline").needs_sum_pi_squared


# -------------------------------------------------------------------------------------- abs KL
def test_abs_kl_value_gradient_and_verl():
    case = DATA["abs_kl"][0]
    lp = torch.tensor(case["logprobs"], dtype=D).requires_grad_(True)
    ref = torch.tensor(case["ref_logprobs"], dtype=D)
    mask = torch.ones_like(ref, dtype=torch.bool)
    kl = kl_penalty(lp, ref, mask, estimator="abs")  # every |log_ratio| < kl_clamp here
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    loop_v = [[abs(a - b) for a, b in zip(ra, rb)] for ra, rb in zip(case["logprobs"], case["ref_logprobs"])]
    loop_g = [[math.copysign(1.0, a - b) for a, b in zip(ra, rb)] for ra, rb in zip(case["logprobs"], case["ref_logprobs"])]
    torch.testing.assert_close(kl.detach(), torch.tensor(loop_v, dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, torch.tensor(loop_g, dtype=D), rtol=0, atol=0)
    torch.testing.assert_close(kl.detach(), torch.tensor(case["value"], dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, torch.tensor(case["grad"], dtype=D), rtol=0, atol=0)
    # by hand: log ratios ln 2 and -ln 3
    lp2, ref2 = torch.log(torch.tensor([[0.5, 0.1]], dtype=D)), torch.log(torch.tensor([[0.25, 0.3]], dtype=D))
    torch.testing.assert_close(KL_ESTIMATORS["abs"](lp2, ref2), torch.tensor([[math.log(2), math.log(3)]], dtype=D),
                               rtol=0, atol=1e-15)
    info = check_kl_loss_estimator("abs")  # a non-zero (L1) loss gradient: accepted in kl.mode=loss
    assert info.loss_gradient == GRAD_L1 and not info.straight_through
    assert KLConfig(kl_coef=0.1, mode="loss", estimator="abs").estimator == "abs"


# -------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("name,extra,kl_mode", [
    ("pass_at_k", {"advantage.k": 3}, "loss"), ("opo", {}, "loss"), ("remax", {}, "reward"),
])
def test_each_new_estimator_is_chosen_by_name_and_reaches_its_function(name, extra, kl_mode):
    cfg = load_config(None, {"advantage.estimator": name, "rollout.n_samples_per_prompt": 4, **extra})
    assert cfg.advantage.estimator == name and cfg.kl.mode == kl_mode
    assert cfg.needs_greedy_baseline == (name == "remax") and not cfg.needs_critic
    kwargs = estimator_kwargs(cfg.advantage)
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # group 0: n_neg = 3 >= k, a pass@3 signal
    groups, mask = torch.tensor([0] * 4 + [1] * 4), torch.ones(8, 2, dtype=torch.bool)
    if name == "remax":
        kwargs["reward_baselines"] = torch.zeros(8)
    adv, _ = ADVANTAGE_ESTIMATORS[name](r, groups, mask, **kwargs)
    assert adv.shape == (8, 2) and adv[:4].abs().sum() > 0
    if name == "pass_at_k":
        assert kwargs == {"k": 3, "eps": 1e-6}


def test_config_refuses_k_beyond_the_group_size_and_remax_with_an_agent():
    with pytest.raises(ConfigError, match=r"advantage.k=5 exceeds rollout.n_samples_per_prompt=4: .*between 1 and the "
                                          "group size"):
        load_config(None, {"advantage.estimator": "pass_at_k", "advantage.k": 5, "rollout.n_samples_per_prompt": 4})
    with pytest.raises(ConfigError, match="advantage.k"):
        load_config(None, {"advantage.estimator": "pass_at_k", "advantage.k": 0})
    with pytest.raises(ConfigError, match=r"advantage.estimator=remax .*multi-turn rollout \(rollout.agent\)"):
        load_config(None, {"advantage.estimator": "remax", "rollout.agent.environment": "calculator"})
    assert load_config(None, {"advantage.estimator": "remax", "rollout.n_samples_per_prompt": 1}).advantage.estimator == "remax"


# ------------------------------------------------------------- ReMax through the stage programs
def test_remax_stages_greedy_rollout_rewards_and_advantages(tiny_model, tmp_path, monkeypatch):
    from rft_core import stages
    from rft_core.rewards.math import RewardResult
    from rft_core.stages.contracts import AdvantagesInput, PromptsInput, RewardsInput, RolloutInput
    from rft_core.stages.evaluate import greedy_generate
    from rft_core.models.loading import load_causal_lm, load_tokenizer
    from schemas import read_manifest, read_shard

    monkeypatch.setattr("rft_core.rewards.math.score_response",  # a deterministic reward of the text: 0 or 1
                        lambda text, **kw: RewardResult(float(zlib.crc32(text.encode()) % 2), False, "7", {}))
    cfg = load_config(None, {"policy.path": tiny_model, "data.prompts_per_iteration": 3, "rollout.n_samples_per_prompt": 2,
                             "rollout.max_new_tokens": 6, "advantage.estimator": "remax", "kl.kl_coef": 0})
    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=str(tmp_path / "prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1,
                                        out=str(tmp_path / "rollout")))
    g_inp = RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, greedy=True,
                         out=str(tmp_path / "baseline_rollout"))
    assert g_inp.config_hash() != g_inp.model_copy(update={"greedy": False}).config_hash()
    g = stages.rollout.run(g_inp)
    greedy = read_shard(g, stage="rollout")
    prompts = read_shard(p, stage="prompts")
    assert greedy.num_rows == prompts.num_rows == 3 and read_manifest(g.uri)[0].summary["decoding"] == "greedy"
    assert greedy.column("sample_id").to_pylist() == [f"{pid}#0" for pid in prompts.column("prompt_id").to_pylist()]
    # the argmax responses, as the eval stage's greedy decoder gives them
    want = greedy_generate(load_causal_lm(tiny_model), load_tokenizer(tiny_model),
                           prompts.column("prompt_token_ids").to_pylist(), max_new_tokens=6, batch_size=4)
    assert greedy.column("response_token_ids").to_pylist() == [w.response_token_ids for w in want]
    w = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=str(tmp_path / "rewards")))
    gw = stages.rewards.run(RewardsInput(rollout=g, prompts=p, reward=cfg.reward, out=str(tmp_path / "baseline_rewards")))
    a = stages.advantages.run(AdvantagesInput(rollout=r, rewards=w, baseline_rollout=g, baseline_rewards=gw, kl=cfg.kl,
                                              advantage=cfg.advantage, state=TrainState(), out=str(tmp_path / "adv")))
    base = dict(zip(read_shard(gw, stage="rewards").column("prompt_id").to_pylist(),
                    read_shard(gw, stage="rewards").column("rewards").to_pylist()))
    sampled = read_shard(w, stage="rewards").to_pylist()
    adv = read_shard(a, stage="advantages").to_pylist()
    assert [x["sample_id"] for x in adv] == [x["sample_id"] for x in sampled]
    for s, x in zip(sampled, adv):
        assert x["advantages"] == pytest.approx([s["rewards"] - base[s["prompt_id"]]] * len(x["advantages"]))
    assert {"baseline_rollout", "baseline_rewards"} <= set(read_manifest(a.uri)[0].inputs)
    with pytest.raises(ValueError, match="needs the reward of a greedy response"):
        stages.advantages.run(AdvantagesInput(rollout=r, rewards=w, kl=cfg.kl, advantage=cfg.advantage, state=TrainState(),
                                              out=str(tmp_path / "adv-none")))
    with pytest.raises(ValueError, match="go together"):
        AdvantagesInput(rollout=r, rewards=w, baseline_rollout=g, kl=cfg.kl, advantage=cfg.advantage, state=TrainState(),
                        out=str(tmp_path / "adv-half"))


def test_gpu_engines_decode_greedily_when_asked(tiny_model):
    from rft_core.engines.hf import HFEngine
    from rft_core.engines.sglang import SGLangEngine
    from rft_core.engines.vllm import VLLMEngine
    from rft_core.models.loading import load_causal_lm, load_tokenizer
    from tests.rft_core.engines.fakes import HFBackedLLM, HFBackedSGLang, SamplingParams

    model, tok = load_causal_lm(tiny_model).eval(), load_tokenizer(tiny_model)
    prompts = [[1, 20, 30], [1, 40], [7, 8, 9, 10]]
    hf = HFEngine(model, tok)
    want = [g.response_token_ids for g in hf.generate(prompts, n_samples_per_prompt=1, max_new_tokens=5, greedy=True)]
    llm = HFBackedLLM(model, tok)
    vllm = VLLMEngine("unused", eos_ids=hf.eos_ids, llm=llm, sampling_params=SamplingParams)
    got = vllm.generate(prompts, n_samples_per_prompt=1, max_new_tokens=5, temperature=0.7, top_p=0.9, greedy=True)
    assert all(sp.temperature == 0.0 and sp.top_p == 1.0 for sp in llm.calls[0][1])
    assert [g.response_token_ids for g in got] == want
    fake = HFBackedSGLang(model, tok)
    sgl = SGLangEngine("unused", eos_ids=hf.eos_ids, engine=fake, deterministic=True)
    got = sgl.generate(prompts, n_samples_per_prompt=1, max_new_tokens=5, temperature=0.7, top_p=0.9, greedy=True)
    assert all(sp["temperature"] == 0.0 and sp["top_p"] == 1.0 for sp in fake.calls[0][1])
    assert [g.response_token_ids for g in got] == want


def test_replay_sources_carry_the_greedy_baseline(tmp_path):
    from rft_core.replay import replay_sources
    from schemas import stage_uri, write_shard
    from schemas.columns import PROMPTS

    root = str(tmp_path / "run")
    empty = pa.table({f.name: pa.array([], f.type) for f in PROMPTS.schema}, schema=PROMPTS.arrow)
    for stage in ("prompts", "rollout", "rewards"):
        write_shard(empty, stage_uri(root, 1, stage), schema=PROMPTS, config_hash="x")
    cfg = load_config(None, {"advantage.estimator": "remax"})
    with pytest.raises(ValueError, match=r"remax needs the greedy responses .*baseline_rollout, baseline_rewards"):
        replay_sources(root, 1, cfg)
    for stage in ("baseline_rollout", "baseline_rewards"):
        write_shard(empty, stage_uri(root, 1, stage), schema=PROMPTS, config_hash="x")
    assert {"baseline_rollout", "baseline_rewards"} <= set(replay_sources(root, 1, cfg))
    assert "baseline_rollout" not in replay_sources(root, 1, load_config(None, {}))
