"""``UpdateSettings``: the config sections the update stage passes to ``ppo_update`` as they are
(no field copied), and the seeds of one update (``update_seeds``)."""
from __future__ import annotations

import pytest

from rft_core.config import KLConfig, UpdateConfig
from rft_core.stages.contracts import PPOUpdateInput
from rft_core.stages.update import update_settings
from rft_core.training.update import RANK_STRIDE, VERSION_STRIDE, UpdateSettings, update_seeds
from schemas import ShardRef

REF = ShardRef(uri="memory://x/iter=000002/advantages", stage="advantages", num_rows=1, config_hash="h",
               manifest_sha256="a" * 64)


def test_the_update_stage_passes_its_sections_as_they_are():
    upd = UpdateConfig.model_validate({"policy_loss": {"name": "cpgd", "clip_low": 0.1}, "cpgd_drift_coef": 0.5,
                                       "seed": 11, "loss_agg": "seq-mean-token-sum-norm", "loss_norm_tokens": 7})
    kl = KLConfig(kl_coef=0.3, mode="loss", estimator="k2", kl_clamp=4.0)
    inp = PPOUpdateInput(rollout=REF, advantages=REF, policy="p", update=upd, kl=kl, temperature=0.7, policy_version=2,
                         out="/x/iter=000003/ppo_update")
    got = update_settings(inp)
    assert got.update is upd and got.kl is kl and (got.temperature, got.policy_version) == (0.7, 2)
    # an update outside a flow (no policy_version) starts from version 0, as the first iteration's
    assert update_settings(inp.model_copy(update={"policy_version": None})).policy_version == 0


def test_settings_refuse_what_the_update_cannot_run():
    with pytest.raises(ValueError, match="needs update.loss_norm_tokens"):
        UpdateSettings(UpdateConfig(loss_agg="seq-mean-token-sum-norm"))
    with pytest.raises(ValueError, match="policy_version must be >= 0"):
        UpdateSettings(policy_version=-1)


def test_each_iteration_and_rank_draws_with_its_own_seed():
    # the first iteration's update (version 0) on rank 0 keeps update.seed itself
    assert update_seeds(5, 0) == (5, 5)
    assert update_seeds(5, 2) == (5 + 2 * VERSION_STRIDE,) * 2
    # rank 1 shuffles as rank 0 (the ranks deal one order) but draws its own masks
    assert update_seeds(5, 2, rank=1) == (5 + 2 * VERSION_STRIDE, 5 + 2 * VERSION_STRIDE + RANK_STRIDE)
    seeds = {update_seeds(s, v, r)[1] for s in range(3) for v in range(50) for r in range(8)}
    assert len(seeds) == 3 * 50 * 8  # no two (seed, version, rank) share a stream
    with pytest.raises(ValueError, match="must be >= 0"):
        update_seeds(0, -1)
