"""``orchestration.workers: auto`` (the default, issue 44): resident workers when a CUDA device is
visible, Ray is installed and resident workers cover the config; stage mode otherwise. The choice
is made when the config loads, so every check after it (``checkpoint.every`` needs resident, the
resident blockers) sees the mode chosen, and the run logs ``workers_choice``."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import rft_core.config as config_module
from rft_core.config import ConfigError, load_config

BASE = ["policy.path=/tmp/no-model-needed"]


@pytest.fixture
def machine(monkeypatch):
    """Set what the config sees: ``machine(cuda=..., ray=...)``."""
    real_find_spec = importlib.util.find_spec

    def set_(*, cuda: bool, ray: bool) -> None:
        monkeypatch.setattr(config_module, "default_device", lambda: torch.device("cuda:0" if cuda else "cpu"))
        monkeypatch.setattr(config_module.importlib.util, "find_spec",
                            lambda name, *a: (real_find_spec(name, *a) if name != "ray" else (object() if ray else None)))
    return set_


def test_auto_is_the_default_and_picks_stage_without_a_gpu(machine):
    machine(cuda=False, ray=True)
    cfg = load_config(None, BASE)
    assert cfg.orchestration.workers == "stage"
    assert cfg.workers_choice == ("orchestration.workers=auto chose stage: no CUDA device is visible (device cpu) and "
                                  "ray.address names no cluster")
    assert cfg.runner("rollout").mode == "inprocess" and cfg.keeps_models
    # stage mode keeping its models writes the checkpoints in the background too (checkpoint.async_weights, the default)
    assert cfg.background_checkpoint
    assert not load_config(None, [*BASE, "orchestration.keep_models=false"]).background_checkpoint
    assert not load_config(None, [*BASE, "checkpoint.async_weights=false"]).background_checkpoint


def test_auto_picks_resident_on_a_gpu_with_ray(machine):
    machine(cuda=True, ray=True)
    cfg = load_config(None, BASE)
    assert cfg.orchestration.workers == "resident"
    assert cfg.workers_choice == "orchestration.workers=auto chose resident: a CUDA device is visible and Ray is installed"
    assert cfg.runner("rollout").mode == "resident" and cfg.runner("ppo_update").workers.pool == cfg.run_root
    assert cfg.background_checkpoint
    # the resident mode's own rules then hold: checkpoint.every > 1 is allowed
    assert load_config(None, [*BASE, "checkpoint.every=3"]).orchestration.workers == "resident"


def test_auto_picks_stage_on_a_gpu_without_ray_or_when_resident_does_not_cover_the_config(machine):
    machine(cuda=True, ray=False)
    cfg = load_config(None, BASE)
    assert cfg.orchestration.workers == "stage" and "Ray is not installed" in cfg.workers_choice
    # stage mode keeps the policy between checkpoints where it keeps its models (the hf engine), else refuses
    assert load_config(None, [*BASE, "checkpoint.every=3"]).orchestration.workers == "stage"
    with pytest.raises(ConfigError, match="checkpoint.every=3 keeps the policy in memory between checkpoints.*"
                                          "orchestration.keep_models=false"):
        load_config(None, [*BASE, "checkpoint.every=3", "orchestration.keep_models=false"])
    machine(cuda=True, ray=True)
    cfg = load_config(None, [*BASE, "orchestration.policy_ranks=2"])  # several ranks need update.deepspeed
    assert cfg.orchestration.workers == "stage"
    assert "resident workers do not cover this config: orchestration.policy_ranks=2" in cfg.workers_choice


def test_auto_picks_resident_for_a_driver_without_a_gpu_in_front_of_a_ray_cluster(machine):
    machine(cuda=False, ray=True)
    cfg = load_config(None, [*BASE, "ray.address=ray://head:10001"])
    assert cfg.orchestration.workers == "resident"
    assert cfg.workers_choice == ("orchestration.workers=auto chose resident: ray.address names a cluster "
                                  "(ray://head:10001) and Ray is installed")


def test_an_explicit_mode_is_kept_and_not_explained(machine):
    machine(cuda=True, ray=True)
    cfg = load_config(None, [*BASE, "orchestration.workers=stage"])
    assert cfg.orchestration.workers == "stage" and cfg.workers_choice == "orchestration.workers=stage (set in the config)"
    machine(cuda=False, ray=False)
    assert load_config(None, [*BASE, "orchestration.workers=resident"]).orchestration.workers == "resident"


def test_a_config_auto_chose_for_dumps_auto_and_is_chosen_again_where_it_loads(machine):
    """A deployment or a stage subprocess loads a dumped config on another machine: ``auto`` is
    dumped as ``auto`` and chosen there."""
    machine(cuda=False, ray=True)
    cfg = load_config(None, BASE)
    dumped = cfg.model_dump(mode="json")
    assert dumped["orchestration"]["workers"] == "auto" and cfg.orchestration.workers == "stage"
    assert config_module.TrainConfig.model_validate(dumped) == cfg
    machine(cuda=True, ray=True)  # the machine that loads it has a GPU
    assert config_module.TrainConfig.model_validate(dumped).orchestration.workers == "resident"
    explicit = load_config(None, [*BASE, "orchestration.workers=stage"])
    assert explicit.model_dump(mode="json")["orchestration"]["workers"] == "stage"


def test_auto_picks_resident_with_a_sharded_critic_and_says_where_its_stages_run(machine):
    """A DeepSpeed or FSDP2 critic used to keep auto on stage mode (the resident critic worker
    trained in one process). Now it runs in the resident critic gang of
    ``orchestration.critic_ranks`` ranks; with ``runners.critic_values`` / ``runners.critic_update``
    given, those stages run as the runners say beside the resident workers, the run's first line
    says so, and the task's process keeps no model beside the workers."""
    machine(cuda=True, ray=True)
    for sharded in ("critic.fsdp.cpu_offload=false", "critic.deepspeed.zero_stage=2"):
        gang = load_config(None, [*BASE, "advantage.estimator=gae", sharded, "orchestration.critic_ranks=2"])
        assert gang.orchestration.workers == "resident" and "critic's stages" not in gang.workers_choice
        assert [gang.runner(s).mode for s in ("critic_values", "critic_update", "ppo_update")] == ["resident"] * 3
        assert gang.runner("critic_update").workers.critic_ranks == 2 and gang.first_resident_stages[-2:] == (
            "critic_values", "critic_update")
        cfg = load_config(None, [*BASE, "advantage.estimator=gae", sharded, "runners.critic_update.mode=subprocess",
                                 "runners.critic_update.launcher=torchrun", "runners.critic_update.nproc_per_node=2"])
        assert cfg.orchestration.workers == "resident"
        assert cfg.workers_choice.startswith("orchestration.workers=auto chose resident: a CUDA device is visible and "
                                             "Ray is installed; the DeepSpeed or FSDP2 critic's stages run beside")
        assert [cfg.runner(s).mode for s in ("critic_values", "critic_update", "ppo_update")] == [
            "inprocess", "subprocess", "resident"]
        assert cfg.runner("critic_update").nproc_per_node == 2
        assert not cfg.runner("critic_values").keep_models and cfg.keeps_models
    plain = load_config(None, [*BASE, "advantage.estimator=gae"])  # a one-process critic has its resident worker
    assert plain.runner("critic_update").mode == "resident" and "critic's stages" not in plain.workers_choice
