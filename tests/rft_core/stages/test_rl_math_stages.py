"""Issue 16 wired through the advantages and ppo_update stage programs on hand-made shards: the
reward-mode KL penalty after the group statistics (and after whitening), loss mode leaving the
rewards alone, overlong filtering (advantages zeroed, rows out of the update's loss), and the
rollout correction's weights and metrics in the update's manifest and the iteration metrics."""
from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from rft_core.config import (
    GRPOAdvantage,
    KLConfig,
    RolloutCorrectionConfig,
    ShapingConfig,
    TrainState,
    UpdateConfig,
)
from rft_core.metrics import format_metrics_line, iteration_metrics
from rft_core.models.loading import load_causal_lm
from rft_core.models.logprobs import batched_response_logprobs
from rft_core.stages import advantages as adv_stage
from rft_core.stages import update as upd_stage
from rft_core.stages.contracts import AdvantagesInput, PPOUpdateInput
from schemas import read_manifest, read_shard, write_shard
from schemas.batch import join_column_groups
from schemas.columns import ACTOR_LOGPROBS, REF_LOGPROBS, REWARDS, ROLLOUT, policy_version_column, single_turn_columns

# two prompts x two samples; prompt "b" has equal task rewards
PROMPT_IDS = ["a", "a", "b", "b"]
REWARDS_ = [1.0, 0.0, 1.0, 1.0]
LENGTHS = [3, 2, 4, 3]
FINISH = ["stop", "length", "stop", "stop"]
RHO = [0.5, 1.0, 1.5, 3.0]  # pi_old / pi_rollout by token position (cycled)
REF_GAP = [0.1, 0.3, 0.2, 0.05]  # per sample: old - ref per token (k1 = REF_GAP * length summed)


def _tables(tiny_model: str | None = None) -> dict[str, pa.Table]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (3,), generator=g).tolist() for _ in PROMPT_IDS]
    responses = [torch.randint(3, 400, (n,), generator=g).tolist() for n in LENGTHS]
    if tiny_model is None:
        old = [[-1.0 - 0.1 * t for t in range(n)] for n in LENGTHS]
    else:
        old = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    rollout_lp = [[o - math.log(RHO[t % len(RHO)]) for t, o in enumerate(row)] for row in old]
    ids = [f"s{i}" for i in range(len(PROMPT_IDS))]
    rollout = pa.table({
        "sample_id": ids, "prompt_id": PROMPT_IDS, "sample_index": [0, 1, 0, 1], "prompt_token_ids": prompts,
        "response_token_ids": responses, "response_text": ["x"] * 4, "rollout_logprobs": rollout_lp,
        "action_mask": [[True] * n for n in LENGTHS], "finish_reason": FINISH, "images": [[]] * 4, "videos": [[]] * 4,
        **single_turn_columns(["x"] * 4), **policy_version_column(4, 0),
    }, schema=ROLLOUT.arrow)
    rewards = pa.table({
        "sample_id": ids, "prompt_id": PROMPT_IDS, "rewards": REWARDS_, "correct": [r > 0 for r in REWARDS_],
        "extracted_answer": ["1"] * 4, "reward_metrics": [[]] * 4, "reward_reasons": [[]] * 4,
    }, schema=REWARDS.arrow)
    actor = pa.table({"sample_id": ids, "old_logprobs": old, "action_entropy": [[1.0] * n for n in LENGTHS]},
                     schema=ACTOR_LOGPROBS.arrow)
    ref = pa.table({"sample_id": ids, "ref_logprobs": [[o - gap for o in row] for row, gap in zip(old, REF_GAP)]},
                   schema=REF_LOGPROBS.arrow)
    return {"rollout": rollout, "rewards": rewards, "actor_logprobs": actor, "ref_logprobs": ref}


def _batch():
    t = _tables()
    return join_column_groups(t["rollout"], rewards=t["rewards"], actor_logprobs=t["actor_logprobs"],
                              ref_logprobs=t["ref_logprobs"])


def _kl_sums() -> torch.Tensor:
    return torch.tensor([gap * n for gap, n in zip(REF_GAP, LENGTHS)])


def test_reward_mode_penalty_comes_after_the_group_statistics_and_whitening():
    kl = KLConfig(kl_coef=0.5, mode="reward", estimator="k1")
    penalty = 0.5 * _kl_sums()
    res = adv_stage.compute_advantages(_batch(), kl_cfg=kl, adv_cfg=GRPOAdvantage())
    a = res["advantages"][:, 0]
    # prompt b: equal task rewards -> exactly minus its own KL term, never a normalised KL difference
    torch.testing.assert_close(a[2:], -penalty[2:], atol=1e-6, rtol=0)
    assert (a[2:].abs() <= penalty[2:] + 1e-6).all()
    torch.testing.assert_close(res["shaped_rewards"], torch.tensor(REWARDS_) - penalty, atol=1e-6, rtol=0)
    # whitening (batch mean and std) acts on the task advantages only; the KL term is subtracted
    # afterwards at its own scale
    no_kl = adv_stage.compute_advantages(_batch(), kl_cfg=KLConfig(), adv_cfg=GRPOAdvantage(),
                                         shaping=ShapingConfig(advantage_whiten=True))["advantages"]
    white = adv_stage.compute_advantages(_batch(), kl_cfg=kl, adv_cfg=GRPOAdvantage(),
                                         shaping=ShapingConfig(advantage_whiten=True))["advantages"]
    mask = _batch().action_mask
    torch.testing.assert_close(white, no_kl - torch.where(mask, penalty[:, None], torch.zeros(())), atol=1e-5, rtol=0)
    # prompt a, without whitening: (r - mean) / (unbiased std + eps) - penalty = +-0.5 / (0.7071 + 1e-6) - penalty
    res = adv_stage.compute_advantages(_batch(), kl_cfg=kl, adv_cfg=GRPOAdvantage())
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(res["advantages"][:2, 0], torch.tensor([z, -z]) - 0.5 * _kl_sums()[:2], atol=1e-5, rtol=0)


def test_loss_mode_leaves_the_rewards_alone():
    kl = KLConfig(kl_coef=0.5, mode="loss", estimator="k3+")
    res = adv_stage.compute_advantages(_batch(), kl_cfg=kl, adv_cfg=GRPOAdvantage())
    assert float(res["advantages"][2:].abs().max()) == 0.0
    torch.testing.assert_close(res["shaped_rewards"], torch.tensor(REWARDS_))
    # the kl column still reports the estimator's value (k3 of the log-ratio gap)
    k3 = [(math.exp(-gap) - 1 + gap) * n for gap, n in zip(REF_GAP, LENGTHS)]
    torch.testing.assert_close(res["kl"].sum(-1), torch.tensor(k3), atol=1e-5, rtol=0)


def test_overlong_filter_zeroes_truncated_advantages_and_checks_finish_reasons():
    kl = KLConfig(kl_coef=0.5, mode="reward", estimator="k1")
    res = adv_stage.compute_advantages(_batch(), kl_cfg=kl, adv_cfg=GRPOAdvantage(), shaping=ShapingConfig(overlong_filter=True))
    assert res["overlong_filtered"].tolist() == [False, True, False, False]
    assert float(res["advantages"][1].abs().max()) == 0.0 and float(res["advantages"][0, :LENGTHS[0]].abs().min()) > 0.5
    assert res["metrics"]["overlong_filtered_frac"] == 0.25
    bad = _batch()
    bad.finish_reason[3] = "abort"
    with pytest.raises(ValueError, match=r"finish_reason\[3\] = 'abort'; valid: stop, length"):
        adv_stage.compute_advantages(bad, kl_cfg=kl, adv_cfg=GRPOAdvantage(), shaping=ShapingConfig(overlong_filter=True))


def test_stages_filter_overlong_rows_and_correct_the_rollout_distribution(tiny_model, tmp_path):
    tables = _tables(tiny_model)
    refs = {name: write_shard(t, str(tmp_path / name), schema={"rollout": ROLLOUT, "rewards": REWARDS,
                                                                   "actor_logprobs": ACTOR_LOGPROBS,
                                                                   "ref_logprobs": REF_LOGPROBS}[name], config_hash="h")
            for name, t in tables.items()}
    kl = KLConfig(kl_coef=0.5, mode="reward", estimator="k1")
    adv = adv_stage.run(AdvantagesInput(rollout=refs["rollout"], rewards=refs["rewards"],
                                        actor_logprobs=refs["actor_logprobs"], ref_logprobs=refs["ref_logprobs"], kl=kl,
                                        advantage=GRPOAdvantage(), shaping=ShapingConfig(overlong_filter=True),
                                        state=TrainState(kl_coef=0.5), out=str(tmp_path / "advantages")))
    summary = read_manifest(adv.uri)[0].summary
    assert summary["overlong_filter"] is True and summary["overlong_filtered_frac"] == 0.25
    assert (summary["kl_mode"], summary["kl_estimator"]) == ("reward", "k1")
    assert adv_stage.overlong_filtered(adv)
    firsts = [a[0] for a in read_shard(adv).column("advantages").to_pylist()]
    assert firsts[1] == 0.0 and firsts[2] == pytest.approx(-0.5 * REF_GAP[2] * LENGTHS[2], abs=1e-5)

    update = UpdateConfig(lr=1e-3, rollout_correction=RolloutCorrectionConfig(enabled=True, mode="tis", cap=2.0))
    inp = PPOUpdateInput(rollout=refs["rollout"], advantages=adv, actor_logprobs=refs["actor_logprobs"], policy=tiny_model,
                         update=update, kl=kl, temperature=1.0, out=str(tmp_path / "ppo_update"))
    data = upd_stage.update_data(inp)
    assert data.excluded == [False, True, False, False] and data.rollout_logprobs is not None
    new = upd_stage.run(inp)
    s = read_manifest(new.uri)[0].summary
    kept_rows = [0, 2, 3]
    rho = [RHO[t % len(RHO)] for i in kept_rows for t in range(LENGTHS[i])]
    assert s["rollout_is_weight_mean"] == pytest.approx(sum(min(p, 2.0) for p in rho) / len(rho), abs=1e-4)
    assert s["rollout_is_capped_frac"] == pytest.approx(sum(p > 2.0 for p in rho) / len(rho))
    assert s["rollout_kl"] == pytest.approx(-sum(math.log(p) for p in rho) / len(rho), abs=1e-4)
    steps = read_shard(new).to_pylist()
    assert [r["num_tokens"] for r in steps] == [sum(LENGTHS[i] for i in kept_rows)]
    m = iteration_metrics(1, {"advantages": adv, "ppo_update": new})
    assert m["overlong_filtered_frac"] == 0.25 and m["rollout_is_weight_mean"] == s["rollout_is_weight_mean"]
    assert "is_w" in format_metrics_line(m) and "overlong_filtered 0.250" in format_metrics_line(m)
    # without the actor stage the old log-probs are the engine's: the correction cannot be on
    with pytest.raises(ValueError, match="rollout_correction needs the trainer's old log-probs"):
        upd_stage.update_data(inp.model_copy(update={"actor_logprobs": None}))
