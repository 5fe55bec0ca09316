"""``UpdateSettings.of``: the policy update's settings taken from the ``update`` and ``kl``
config sections and the rollout temperature (what the update stage passes to ``ppo_update``)."""
from __future__ import annotations

import dataclasses

import pytest

from rft_core.config import KLConfig, UpdateConfig, policy_loss_kwargs
from rft_core.training.update import UpdateSettings


def _config() -> UpdateConfig:
    """An update section whose every field that the update reads differs from its default."""
    return UpdateConfig.model_validate({
        "policy_loss": {"name": "cpgd", "clip_low": 0.1, "clip_high": 0.3}, "loss_agg": "seq-mean-token-sum-norm",
        "loss_norm_tokens": 7, "epochs": 3, "train_batch_size": 5, "micro_batch_size": 2, "entropy_coef": 0.01,
        "entropy_top_fraction": 0.2, "entropy_filter_norm": "kept", "dropout": True, "cpgd_drift_coef": 0.5,
        "seed": 11, "packing": True})


def test_of_carries_every_setting_of_the_config_sections():
    cfg = _config()
    got = UpdateSettings.of(cfg, KLConfig(kl_coef=0.3, mode="loss", estimator="k2", kl_clamp=4.0), temperature=0.7)
    assert got == UpdateSettings(
        policy_loss="cpgd", policy_loss_kwargs=policy_loss_kwargs(cfg.policy_loss), loss_agg="seq-mean-token-sum-norm",
        loss_norm_tokens=7, kl_coef=0.3, kl_estimator="k2", kl_clamp=4.0, entropy_coef=0.01, entropy_top_fraction=0.2,
        entropy_filter_norm="kept", cpgd_drift_coef=0.5, dropout=True, epochs=3, train_batch_size=5,
        micro_batch_size=2, temperature=0.7, seed=11, packing=True)
    assert got.policy_loss_kwargs["clip_low"] == 0.1 and got.policy_loss_kwargs["clip_high"] == 0.3
    # the test can fail: every setting differs from UpdateSettings' default, so a field not carried shows
    defaults = UpdateSettings()
    same = [f.name for f in dataclasses.fields(UpdateSettings) if getattr(got, f.name) == getattr(defaults, f.name)]
    assert same == []


def test_a_kl_outside_the_loss_gives_no_kl_term():
    for kl in (KLConfig(kl_coef=0.3, mode="reward"), KLConfig(kl_coef=0.0, mode="loss")):
        assert UpdateSettings.of(_config(), kl, temperature=1.0).kl_coef == 0.0


def test_settings_refuse_what_the_update_cannot_run():
    with pytest.raises(ValueError, match="entropy_filter_norm must be one of"):
        UpdateSettings(entropy_filter_norm="some")
    with pytest.raises(ValueError, match="needs loss_norm_tokens"):
        UpdateSettings(loss_agg="seq-mean-token-sum-norm")
