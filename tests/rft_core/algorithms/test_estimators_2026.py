"""Issue 38's estimators: the optimal token baseline's ``handle_zero_tail`` and multi-turn form, GPG's
corrected advantage with the paper's alpha (Chu et al. 2025), GDPO (Liu et al. 2026) from the
per-source scores of the rewards shard, and verl's ``abs+`` KL estimator.

Each is checked against a plain-Python float64 loop of its equations, by hand, and against verl's
own numbers (``data/verl_objectives.json``, ``benchmarks/verl_fixtures/make_objective_fixtures.py``,
verl commit 1dda039b), with verl's departures from the paper asserted where the data shows them."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rft_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, kl_penalty
from rft_core.algorithms.baselines import optimal_token_baseline_advantages
from rft_core.algorithms.group_estimators import gdpo_advantages, gpg_advantages
from rft_core.algorithms.kl import GRAD_KL_PI_REF, check_kl_loss_estimator
from rft_core.config import ConfigError, KLConfig, estimator_kwargs, load_config

D = torch.float64
DATA = json.loads((Path(__file__).parent / "data" / "verl_objectives.json").read_text())


def _groups(names: list[str]) -> torch.Tensor:
    order = {g: i for i, g in enumerate(dict.fromkeys(names))}
    return torch.tensor([order[g] for g in names])


# ------------------------------------------------------------------------ optimal token baseline
def _otb_loop(rewards, mask, groups, old_lp, spi2, is_w, zero_tail, eps=1e-8):
    """The OTB of docs/algo/otb.md by action-token index k, with verl's zero-tail rule; outcome
    rewards on the last action token. Returns (B, T) advantages as lists."""
    B, T = len(mask), len(mask[0])
    cols = [[t for t in range(T) if mask[i][t]] for i in range(B)]
    G = [[rewards[i]] * len(c) for i, c in enumerate(cols)]  # the return of every action token is the outcome
    W = []
    for i, c in enumerate(cols):
        acc, row = 0.0, []
        for t in c:
            acc += (1 - 2 * math.exp(old_lp[i][t]) + spi2[i][t]) * (is_w[i][t] ** 2 if is_w is not None else 1.0)
            row.append(acc)
        W.append(row)
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        members = [j for j in range(B) if groups[j] == groups[i] and cols[j]]
        lens = sorted(len(cols[j]) for j in members)
        for k, t in enumerate(cols[i]):
            if len(members) < 2:
                b = 0.0
            elif zero_tail and len(cols[i]) == lens[-1] and lens.count(lens[-1]) == 1 and k >= lens[-2]:
                b = 0.0
            else:
                have = [j for j in members if len(cols[j]) > k]
                b = sum(G[j][k] * W[j][k] for j in have) / (sum(W[j][k] for j in have) + eps)
            adv[i][t] = G[i][k] - b
    return adv


@pytest.mark.parametrize("case", DATA["optimal_token_baseline"], ids=lambda c: c["case"])
def test_optimal_token_baseline_against_the_loop_and_verl(case):
    mask = torch.tensor(case["mask"], dtype=D) > 0
    lp, spi2 = torch.tensor(case["old_logprobs"], dtype=D), torch.tensor(case["sum_pi_squared"], dtype=D)
    w = None if case["rollout_is_weights"] is None else torch.tensor(case["rollout_is_weights"], dtype=D)
    adv, ret = optimal_token_baseline_advantages(torch.tensor(case["rewards"], dtype=D), _groups(case["group"]), mask,
                                                 old_logprobs=lp, sum_pi_squared=spi2, rollout_is_weights=w,
                                                 handle_zero_tail=case["handle_zero_tail"])
    loop = _otb_loop(case["rewards"], mask.tolist(), case["group"], case["old_logprobs"], case["sum_pi_squared"],
                     case["rollout_is_weights"], case["handle_zero_tail"])
    torch.testing.assert_close(adv, torch.tensor(loop, dtype=D), rtol=0, atol=1e-12)
    verl_adv, verl_ret = torch.tensor(case["advantages"], dtype=D), torch.tensor(case["returns"], dtype=D)
    multi = bool((mask.long().diff(dim=-1) > 0).any())  # a row with a False before a True
    if case["case"] == "single_turn_function_on_multi_turn_rows":
        # verl's single-turn OTB aligns positions, not action tokens: on multi-turn rows it is not the multi-turn form
        assert multi and (adv - verl_adv).abs().max() > 1e-3
        return
    torch.testing.assert_close(adv, verl_adv, rtol=0, atol=1e-12)
    # returns: verl's pass through observation tokens; ours are 0 there, the same on action tokens
    torch.testing.assert_close(torch.where(mask, verl_ret, 0.0), ret, rtol=0, atol=1e-12)
    assert multi == case["case"].startswith("multi")


def test_zero_tail_by_hand():
    """Group of two, rewards 1 and 0, lengths 3 and 1, w = 1 - 2 * 0.5 + 0.5 = 0.5 per token: at
    k = 0 B = (1 * 0.5 + 0 * 0.5) / 1 = 0.5; past the second-longest (k >= 1) only the longest
    response has tokens: without zero tail B = G W / (W + eps) ~ 1 (A ~ 0), with it B = 0 (A = 1)."""
    mask = torch.tensor([[True, True, True], [True, False, False]])
    kw = {"old_logprobs": torch.full((2, 3), math.log(0.5), dtype=D), "sum_pi_squared": torch.full((2, 3), 0.5, dtype=D)}
    r, g = torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 0])
    on, _ = optimal_token_baseline_advantages(r, g, mask, **kw)
    off, _ = optimal_token_baseline_advantages(r, g, mask, handle_zero_tail=False, **kw)
    torch.testing.assert_close(on, torch.tensor([[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-8)
    torch.testing.assert_close(off, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-7)
    # a tie for the longest: no tail is zeroed
    tie = torch.tensor([[True, True, True], [True, True, True]])
    a, _ = optimal_token_baseline_advantages(r, g, tie, **kw)
    b, _ = optimal_token_baseline_advantages(r, g, tie, handle_zero_tail=False, **kw)
    assert torch.equal(a, b)
    assert ADVANTAGE_ESTIMATORS["tir_optimal_token_baseline"] is optimal_token_baseline_advantages
    assert not ADVANTAGE_ESTIMATORS.info("optimal_token_baseline").group_baseline  # the zero tail: A = G there


def test_multi_turn_rows_align_by_action_token():
    """An observation token between two turns does not shift the comparison: a row [a, obs, a] is
    compared with [a, a] token for token, as if the observation were not there."""
    kw = {"old_logprobs": torch.full((2, 3), math.log(0.3), dtype=D), "sum_pi_squared": torch.full((2, 3), 0.4, dtype=D)}
    r, g = torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0, 0])
    turns = torch.tensor([[True, False, True], [True, True, False]])
    flat = torch.tensor([[True, True, False], [True, True, False]])
    a, _ = optimal_token_baseline_advantages(r, g, turns, **kw)
    b, _ = optimal_token_baseline_advantages(r, g, flat, **kw)
    torch.testing.assert_close(a[0, [0, 2]], b[0, :2], rtol=0, atol=1e-15)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-15)
    assert a[0, 1] == 0 and a.abs().max() > 0.1


# ------------------------------------------------------------------------------------------ GPG
def _gpg_loop(rewards, groups, scale_by_std=False, eps=1e-4):
    B = len(rewards)
    members = {g: [j for j in range(B) if groups[j] == g] for g in groups}
    flat = {g: len({rewards[j] for j in m}) == 1 for g, m in members.items()}
    M = sum(len(m) for g, m in members.items() if flat[g])
    alpha = B / (B - M) if B > M else 1.0
    out = []
    for i in range(B):
        m = members[groups[i]]
        if flat[groups[i]]:
            out.append(0.0)
            continue
        mean = sum(rewards[j] for j in m) / len(m)
        std = math.sqrt(sum((rewards[j] - mean) ** 2 for j in m) / (len(m) - 1))
        out.append(alpha * (rewards[i] - mean) / (std + eps if scale_by_std else 1.0))
    return out


@pytest.mark.parametrize("scale_by_std", [False, True])
def test_gpg_against_the_loop_and_by_hand(scale_by_std):
    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.2, 0.7, 0.3, 0.3]
    groups = ["a"] * 3 + ["b"] * 3 + ["c"] * 2 + ["d"] * 2
    mask = torch.ones(len(rewards), 2, dtype=torch.bool)
    adv, ret = gpg_advantages(torch.tensor(rewards, dtype=D), _groups(groups), mask, scale_by_std=scale_by_std)
    torch.testing.assert_close(adv[:, 0], torch.tensor(_gpg_loop(rewards, groups, scale_by_std), dtype=D),
                               rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ret[:, 1], torch.tensor(rewards, dtype=D), rtol=0, atol=0)
    if not scale_by_std:  # B = 10, M = 2 (group d): alpha = 10/8; group a: mean 1/3 -> A = 1.25 * 2/3
        assert float(adv[0, 0]) == pytest.approx(1.25 * 2 / 3, abs=1e-15) and float(adv[8:].abs().max()) == 0.0
    flat = gpg_advantages(torch.ones(4, dtype=D), torch.tensor([0, 0, 1, 1]), mask[:4])[0]
    assert float(flat.abs().max()) == 0.0  # every group flat: alpha 1, nothing to learn


@pytest.mark.parametrize("case", DATA["gpg"], ids=lambda c: c["case"])
def test_gpg_against_verl(case):
    """verl's alpha is B / (number of non-zero rewards), the paper's B / (B - M); where the zero
    rewards are exactly the flat groups' they agree; otherwise ours is verl's scaled by
    alpha_paper / alpha_verl, and verl's group of one gets alpha r where ours gets 0."""
    r = torch.tensor(case["rewards"], dtype=D)
    adv, _ = gpg_advantages(r, _groups(case["group"]), torch.ones(len(r), 1, dtype=torch.bool))
    verl = torch.tensor(case["advantages"], dtype=D)
    B = len(r)
    single = torch.tensor([case["group"].count(g) == 1 for g in case["group"]])
    alpha_verl = B / max(int((r != 0).sum()), 1)
    flat = torch.tensor([len({float(r[j]) for j in range(B) if case["group"][j] == g}) == 1 for g in case["group"]])
    alpha_paper = B / (B - int(flat.sum()))
    # verl's alpha is a float32 tensor (int / int64 tensor): 17 / 9 rounds at 3.5e-8
    tol = 1e-14 if alpha_verl == int(alpha_verl) else 1e-7
    torch.testing.assert_close(adv[~single, 0] * alpha_verl / alpha_paper, verl[~single], rtol=tol, atol=1e-15)
    torch.testing.assert_close(verl[single], alpha_verl * r[single], rtol=tol, atol=0)
    assert bool((adv[single] == 0).all())
    if case["case"] == "zeros_are_the_flat_groups":
        assert alpha_verl == alpha_paper
        torch.testing.assert_close(adv[:, 0], verl, rtol=1e-14, atol=1e-15)
    else:
        assert alpha_verl != alpha_paper and bool(single.any())


# ----------------------------------------------------------------------------------------- GDPO
def _gdpo_loop(scores, weights, groups, lengths, eps=1e-6, batch_norm="samples"):
    """Per source: (s - group mean) / (group std + eps) (unbiased; a flat group 0); weighted sum;
    then the batch normalisation over samples, or verl's whitening over the response tokens."""
    B = len(groups)
    total = [0.0] * B
    for name, w in weights.items():
        s = scores[name]
        for i in range(B):
            m = [s[j] for j in range(B) if groups[j] == groups[i]]
            mean = sum(m) / len(m)
            if len(set(m)) == 1:
                continue
            std = math.sqrt(sum((x - mean) ** 2 for x in m) / (len(m) - 1))
            total[i] += w * (s[i] - mean) / (std + eps)
    if batch_norm == "samples":
        mean = sum(total) / B
        std = math.sqrt(sum((x - mean) ** 2 for x in total) / (B - 1))
        return [(x - mean) / (std + eps) for x in total]
    tokens = [x for x, n in zip(total, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in total]


def _mask(lengths, T):
    return torch.tensor([[t < n for t in range(T)] for n in lengths])


@pytest.mark.parametrize("batch_norm", ["samples", "tokens"])
def test_gdpo_against_the_loop(batch_norm):
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 3
    lengths = [3, 1, 4, 2, 2, 2, 5, 1, 3, 3, 4]
    scores = {"acc": [1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1], "fmt": [1.0, 1, 0, 0.5, 1, 0, 1, 1, 0, 0.5, 1],
              "len": [0.2, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]}
    weights = {"acc": 1.0, "fmt": 0.5, "len": 2.0}
    src = {k: torch.tensor(v, dtype=D) for k, v in scores.items()}
    mask = _mask(lengths, 5)
    adv, _ = gdpo_advantages(torch.zeros(11, dtype=D), _groups(groups), mask, source_rewards=src,
                             reward_weights=weights, batch_norm=batch_norm)
    want = torch.tensor(_gdpo_loop(scores, weights, groups, lengths, batch_norm=batch_norm), dtype=D)
    torch.testing.assert_close(adv, torch.where(mask, want[:, None], 0.0), rtol=1e-12, atol=1e-14)
    none, _ = gdpo_advantages(torch.zeros(11, dtype=D), _groups(groups), mask, source_rewards=src,
                              reward_weights=weights, batch_norm="none")
    # each source's group-normalised scores sum to 0 per group, so the batch step only rescales here
    assert float(none[:, 0].std()) != pytest.approx(1.0, abs=1e-2) and float(adv[:, 0].std()) != float(none[:, 0].std())


def test_gdpo_by_hand_keeps_reward_combinations_apart():
    """The paper's point (its fig. 2): two binary rewards, groups of two. Group 0 differs in one reward
    ((1, 0) vs (0, 0)), group 1 in both ((1, 1) vs (0, 0)); GRPO on the sums gives both +-0.707, GDPO
    +-0.707 and +-1.414 (each reward: (1 - 0.5) / (std 0.707 + eps))."""
    g, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 1, dtype=torch.bool)
    src = {"a": torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D), "b": torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=D)}
    adv, _ = gdpo_advantages(torch.zeros(4, dtype=D), g, mask, source_rewards=src, batch_norm="none")
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([s, -s, 2 * s, -2 * s], dtype=D), rtol=1e-12, atol=1e-12)
    grpo, _ = ADVANTAGE_ESTIMATORS["grpo"](src["a"] + src["b"], g, mask)
    assert float(grpo[0, 0]) == pytest.approx(float(grpo[2, 0]), abs=1e-5) and float(grpo[0, 0]) == pytest.approx(s, abs=1e-5)


def test_gdpo_refusals():
    g, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 1, dtype=torch.bool)
    nan = float("nan")
    src = {"a": torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D), "b": torch.tensor([0.0, 1.0, nan, nan], dtype=D)}
    adv, _ = gdpo_advantages(torch.zeros(4, dtype=D), g, mask, source_rewards=src, batch_norm="none")
    assert float(adv[2, 0]) != 0 and not torch.isnan(adv).any()  # group 1's recipe has no "b": it adds nothing there
    for kw, match in (({"reward_weights": {"c": 1.0}}, r"names \['c'\]"), ({"batch_norm": "rows"}, "batch_norm"),
                      ({"source_rewards": {"a": torch.tensor([1.0, nan, 1.0, 0.0], dtype=D)}}, "some samples of a group"),
                      ({"source_rewards": {}}, "at least one")):
        with pytest.raises(ValueError, match=match):
            gdpo_advantages(torch.zeros(4, dtype=D), g, mask, **{"source_rewards": src, **kw})


@pytest.mark.parametrize("case", DATA["gdpo"], ids=lambda c: c["case"])
def test_gdpo_matches_verl(case):
    """verl whitens the weighted sum over the response tokens (``batch_norm="tokens"``); it casts the
    per-source scores to float32 before the group statistics, hence rtol 1e-6. With the paper's
    per-sample normalisation (the default) the numbers differ (the lengths vary)."""
    src = {k: torch.tensor(v, dtype=D) for k, v in case["scores"].items()}
    weights = dict(zip(src, case["weights"])) if case["weights"] else None
    mask = _mask(case["lengths"], case["T"])
    adv, _ = gdpo_advantages(torch.zeros(len(case["group"]), dtype=D), _groups(case["group"]), mask, source_rewards=src,
                             reward_weights=weights, batch_norm="tokens")
    verl = torch.tensor(case["advantages"], dtype=D)
    torch.testing.assert_close(adv, verl, rtol=1e-6, atol=1e-6)
    paper, _ = gdpo_advantages(torch.zeros(len(case["group"]), dtype=D), _groups(case["group"]), mask,
                               source_rewards=src, reward_weights=weights)
    assert (paper - verl).abs().max() > 1e-2


# --------------------------------------------------------------------------------------- abs+ KL
def test_abs_plus_value_gradient_and_verl():
    case = DATA["abs_plus_kl"][0]
    lp = torch.tensor(case["logprobs"], dtype=D).requires_grad_(True)
    ref = torch.tensor(case["ref_logprobs"], dtype=D)
    raw = KL_ESTIMATORS["abs+"](lp, ref)  # unclamped, as verl
    (grad,) = torch.autograd.grad(raw.sum(), lp)
    log_ratio = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(case["logprobs"], case["ref_logprobs"])]
    torch.testing.assert_close(raw.detach(), torch.tensor([[abs(x) for x in r] for r in log_ratio], dtype=D),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, torch.tensor(log_ratio, dtype=D), rtol=0, atol=1e-15)  # k2's gradient
    torch.testing.assert_close(raw.detach(), torch.tensor(case["value"], dtype=D), rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, torch.tensor(case["grad"], dtype=D), rtol=0, atol=1e-15)
    # in kl_penalty the value is clamped at kl_clamp and the gradient saturates (log-ratios 9.5 and -9.0 stay inside)
    lp2 = lp.detach().clone().requires_grad_(True)
    kl = kl_penalty(lp2, ref, torch.ones_like(ref, dtype=torch.bool), estimator="abs+", kl_clamp=5.0)
    (g2,) = torch.autograd.grad(kl.sum(), lp2)
    torch.testing.assert_close(kl.detach(), raw.detach().clamp(max=5.0), rtol=0, atol=0)
    torch.testing.assert_close(g2, torch.tensor(log_ratio, dtype=D).clamp(-5.0, 5.0), rtol=0, atol=1e-15)
    info = check_kl_loss_estimator("abs+")
    assert info.straight_through and info.value_of == "abs" and info.loss_gradient == GRAD_KL_PI_REF
    assert KLConfig(kl_coef=0.1, mode="loss", estimator="abs+").estimator == "abs+"


# ---------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, estimator, kwargs", [
    ({"advantage": "gpg"}, "gpg", {"scale_by_std": False, "eps": 1e-4}),
    ({"advantage": "tir_optimal_token_baseline"}, "tir_optimal_token_baseline", {"eps": 1e-8, "handle_zero_tail": True}),
    ({"advantage": {"estimator": "optimal_token_baseline", "handle_zero_tail": False}}, "optimal_token_baseline",
     {"eps": 1e-8, "handle_zero_tail": False}),
    ({"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0}}}, "gdpo",
     {"reward_weights": {"correctness": 1.0}, "scale_by_std": True, "eps": 1e-6, "batch_norm": "samples"}),
])
def test_each_estimator_is_chosen_by_name(overrides, estimator, kwargs):
    cfg = load_config(None, overrides)
    assert cfg.advantage.estimator == estimator and estimator_kwargs(cfg.advantage) == kwargs
    assert cfg.kl.mode == ("reward" if "optimal_token" in estimator else "loss")
    assert cfg.needs_sum_pi_squared == ("optimal_token" in estimator)


def test_gdpo_rules():
    with pytest.raises(ConfigError, match=r"reward.recipes.default weighs format 0 .*advantage.reward_weights "
                                          r"\(e.g. \{correctness: 1, format: 0\}\)"):
        load_config(None, {"advantage": "gdpo"})
    with pytest.raises(ConfigError, match=r"advantage.reward_weights names \['acc'\]"):
        load_config(None, {"advantage": {"estimator": "gdpo", "reward_weights": {"acc": 1.0}}})
    with pytest.raises(ConfigError, match="shaping.reward_clip"):
        load_config(None, {"advantage": {"estimator": "gdpo", "reward_weights": {"correctness": 1.0}},
                           "shaping.reward_clip": 1.0})


# ------------------------------------------------------- GDPO through the stages, from reward_metrics
def acc_reward(sample) -> float:
    """Varies within a group (a random model earns no task reward)."""
    return float(sum(map(ord, sample.response)) % 2)


def len_reward(sample) -> float:
    return (len(sample.response) % 3) / 2


@pytest.fixture(scope="module")
def gdpo_run(tiny_model, tmp_path_factory):
    from tests.drive import drive

    root = tmp_path_factory.mktemp("gdpo")
    cfg = load_config(None, [
        "advantage.estimator=gdpo", "advantage.reward_weights={acc: 1.0, len: 0.5}", "data.prompts_per_iteration=3",
        "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "rollout.batch_size=12",
        "update.micro_batch_size=6", "iterations=1", f"policy.path={tiny_model}",
        f'reward.sources={{"acc": {{"type": "python", "function": "{__name__}:acc_reward"}}, '
        f'"len": {{"type": "python", "function": "{__name__}:len_reward"}}}}',
        'reward.recipes={"any": [{"source": "acc", "weight": 1.0}, {"source": "len", "weight": 0.5}]}',
        "reward.default_recipe=any", f"run_root={root}"])
    drive(cfg)
    return cfg


def test_gdpo_stage_reads_the_per_source_scores(gdpo_run):
    from rft_core.stages.advantages import reward_source_scores
    from schemas import read_shard, stage_uri
    from schemas.batch import join_column_groups

    cfg = gdpo_run
    rollout, rewards = (read_shard(stage_uri(cfg.run_root, 1, s), stage=s) for s in ("rollout", "rewards"))
    adv_t = read_shard(stage_uri(cfg.run_root, 1, "advantages"), stage="advantages")
    b = join_column_groups(rollout, rewards=rewards, advantages=adv_t)
    metrics = [dict(m) for m in rewards.column("reward_metrics").to_pylist()]
    scores = {k: [m[k] for m in metrics] for k in ("acc", "len")}
    order = {sid: i for i, sid in enumerate(rewards.column("sample_id").to_pylist())}
    scores = {k: [v[order[sid]] for sid in b.sample_id] for k, v in scores.items()}
    assert len(set(scores["acc"])) > 1 and len(set(scores["len"])) > 1
    want = _gdpo_loop(scores, {"acc": 1.0, "len": 0.5}, b.prompt_id, b.response_length.tolist())
    mask = b.action_mask
    torch.testing.assert_close(b.advantages.to(D), torch.where(mask, torch.tensor(want, dtype=D)[:, None], 0.0),
                               rtol=0, atol=2e-6)
    got = reward_source_scores(b.sample_id, rewards)
    assert sorted(got) == ["acc", "len"]  # the scores, not 'source.extra' keys
    with pytest.raises(ValueError, match="no sample of the rewards shard has a score of 'fmt'"):
        reward_source_scores(b.sample_id, rewards, names=["fmt"])
    with pytest.raises(ValueError, match="has no row in the rewards shard"):
        reward_source_scores(b.sample_id + ["nope"], rewards)
    # a sample whose recipe has no such source: NaN (gdpo then leaves that source out of its group)
    partial = pa.table({"sample_id": ["x", "y"], "reward_metrics": pa.array(
        [[("acc", 1.0), ("len", 0.5), ("len.fallback", 1.0)], [("acc", 0.0)]], pa.map_(pa.string(), pa.float32()))})
    got = reward_source_scores(["y", "x"], partial)
    assert sorted(got) == ["acc", "len"] and got["acc"].tolist() == [0.0, 1.0]
    assert math.isnan(got["len"][0]) and float(got["len"][1]) == 0.5


def test_gdpo_flat_group_keeps_zero_advantage_with_the_sample_normalisation():
    """Each group's centred scores sum to 0, so the batch mean of S is 0 and a flat group (S = 0)
    keeps A = 0 after the paper's per-sample normalisation; verl's token whitening (a length-weighted
    mean, not 0 here) gives it -mean_T S / std_T S."""
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    mask = torch.ones(8, 3, dtype=torch.bool)
    mask[0, 1:] = False
    src = {"a": torch.tensor([1, 0, 1, 0.5, 0.5, 0.5, 1, 0], dtype=D),
           "b": torch.tensor([0.2, 0.7, 0.1, 0.3, 0.3, 0.3, 0, 1], dtype=D)}
    samples, _ = gdpo_advantages(torch.zeros(8, dtype=D), g, mask, source_rewards=src)
    tokens, _ = gdpo_advantages(torch.zeros(8, dtype=D), g, mask, source_rewards=src, batch_norm="tokens")
    assert float(samples[:, 0].abs().max()) > 0.5  # the other groups are not flat
    assert float(samples[3:6].abs().max()) < 1e-14
    assert float(tokens[3:6, 0].abs().min()) > 0.1
