"""One place per setting (issue 37): the Ray cluster is the ``ray`` section, read by the rollout
fan-out and the resident workers alike, and resident workers are asked for one way
(``orchestration.workers: resident``). Each old key still works for one release: it warns naming
its new key, and its value lands in the new field (rft_core/config/deprecated.py, docs/config.md
"Renamed keys")."""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

import rft_core.config as config_package
from rft_core.config import (
    RAY_ROLES,
    ROLLOUT_SHARD,
    ConfigError,
    DeprecatedKeyWarning,
    TrainConfig,
    load_config,
)

RESIDENT = {"orchestration.workers": "resident"}
DEEPSPEED = {"update.deepspeed.zero_stage": 2}  # several policy ranks are DeepSpeed data parallelism


def _resident_runner(**workers) -> dict:
    """The old way to ask for a resident worker: a runner of mode resident with its pool."""
    return {"runners.ppo_update": {"mode": "resident", "workers": {"pool": "p", **workers}}}


def _value(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# (old key, overrides that use it, the new key its warning names, where the value lands, the value)
CASES = [
    ("orchestration.ray_address", {"orchestration.ray_address": "ray://head:10001"},
     "ray.address", "ray.address", "ray://head:10001"),
    ("orchestration.ray_init_kwargs", {"orchestration.ray_init_kwargs": {"num_cpus": 3}},
     "ray.init_kwargs", "ray.init_kwargs", {"num_cpus": 3}),
    ("orchestration.worker_options", {"orchestration.worker_options": {"reference": {"num_gpus": 0.5}}},
     "ray.options", "ray.options", {"reference": {"num_gpus": 0.5}}),
    ("runners.rollout.ray_address", {"runners.rollout.shards": 2, "runners.rollout.ray_address": "auto"},
     "ray.address", "ray.address", "auto"),
    ("runners.rollout.ray_init_kwargs", {"runners.rollout.shards": 2, "runners.rollout.ray_init_kwargs": {"num_cpus": 2}},
     "ray.init_kwargs", "ray.init_kwargs", {"num_cpus": 2}),
    ("runners.rollout.ray_remote_options", {"runners.rollout.shards": 2,
                                            "runners.rollout.ray_remote_options": {"num_gpus": 1}},
     "ray.options.rollout_shard", "ray.options", {ROLLOUT_SHARD: {"num_gpus": 1}}),
    ("runners.ppo_update.mode=resident", _resident_runner(),
     "orchestration.workers=resident", "orchestration.workers", "resident"),
    ("runners.ppo_update.workers.ray_address", _resident_runner(ray_address="auto"),
     "ray.address", "ray.address", "auto"),
    ("runners.ppo_update.workers.ray_init_kwargs", _resident_runner(ray_init_kwargs={"num_cpus": 1}),
     "ray.init_kwargs", "ray.init_kwargs", {"num_cpus": 1}),
    ("runners.ppo_update.workers.options", _resident_runner(options={"policy": {"num_gpus": 2}}),
     "ray.options", "ray.options", {"policy": {"num_gpus": 2}}),
    ("runners.ppo_update.workers.threads", _resident_runner(threads=3),
     "orchestration.worker_threads", "orchestration.worker_threads", 3),
    ("runners.ppo_update.workers.sync_timeout_s", _resident_runner(sync_timeout_s=60.0),
     "orchestration.sync_timeout_s", "orchestration.sync_timeout_s", 60.0),
    ("runners.ppo_update.workers.sync_bucket_mb", _resident_runner(sync_bucket_mb=64),
     "orchestration.sync_bucket_mb", "orchestration.sync_bucket_mb", 64),
    ("runners.ppo_update.workers.policy_ranks", {**_resident_runner(policy_ranks=2), **DEEPSPEED},
     "orchestration.policy_ranks", "orchestration.policy_ranks", 2),
]


@pytest.mark.parametrize("old, overrides, new, field, value", CASES, ids=[c[0] for c in CASES])
def test_an_old_key_warns_naming_its_new_key_and_its_value_lands_there(old, overrides, new, field, value):
    with pytest.warns(DeprecatedKeyWarning) as record:
        cfg = load_config(None, overrides)
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecatedKeyWarning)]
    mine = [m for m in messages if m.startswith(f"{old} ")]
    assert len(mine) == 1, messages
    assert mine[0].startswith(f"{old} is deprecated (read as {new} this release, removed in the next): write {new}")
    assert _value(cfg, field) == value
    if old.startswith("runners.ppo_update."):  # the old resident runner: now orchestration.workers, no runner left
        assert "ppo_update" not in cfg.runners and cfg.orchestration.workers == "resident"
        workers = cfg.runner("ppo_update").workers
        runtime = {"ray.address": workers.ray.address, "ray.init_kwargs": workers.ray.init_kwargs,
                   "ray.options": workers.ray.options, "orchestration.worker_threads": workers.threads,
                   "orchestration.sync_timeout_s": workers.sync_timeout_s,
                   "orchestration.sync_bucket_mb": workers.sync_bucket_mb,
                   "orchestration.policy_ranks": workers.policy_ranks}
        if field in runtime:  # and it reaches the pool's runtime object
            assert runtime[field] == value
        assert workers.pool == cfg.run_root  # filled in by the run, whatever the old pool said


@pytest.mark.parametrize("key, value, source, field, want", [
    ("pool", "p", "the run root", "pool", "/tmp/run-a"),
    ("rollout_versions", 3, "rollout.max_staleness", "rollout_versions", 1),
    ("rollout_gpus", 4, "the rollout engine's tensor_parallel_size", "rollout_gpus", 1),
])
def test_the_old_resident_runners_filled_in_keys_are_ignored_with_a_warning(key, value, source, field, want):
    with pytest.warns(DeprecatedKeyWarning) as record:
        cfg = load_config(None, {"runners.ppo_update": {"mode": "resident", "workers": {"pool": "p", key: value}},
                                 "run_root": "/tmp/run-a"})
    assert (f"runners.ppo_update.workers.{key} is deprecated and no setting: the run fills it in from {source}; "
            "remove it") in [str(w.message) for w in record]
    assert getattr(cfg.runner("ppo_update").workers, field) == want


def test_shard_options_of_a_stage_that_is_never_sharded_are_dropped_with_a_warning():
    with pytest.warns(DeprecatedKeyWarning, match=r"runners.ppo_update.ray_remote_options is deprecated and did "
                                                  r"nothing \(only the rollout is sharded"):
        cfg = load_config(None, {"runners.ppo_update": {"mode": "subprocess", "ray_remote_options": {"num_gpus": 1}}})
    assert cfg.ray.options == {} and cfg.runner("ppo_update").mode == "subprocess"


def test_a_sharded_rollouts_old_keys_reach_the_fan_out_through_the_ray_section():
    with pytest.warns(DeprecatedKeyWarning):
        old = load_config(None, {"runners.rollout": {"shards": 4, "ray_address": "auto", "ray_init_kwargs": {"num_cpus": 8},
                                                     "ray_remote_options": {"num_gpus": 1}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKeyWarning)
        new = load_config(None, {"runners.rollout.shards": 4, "ray": {"address": "auto", "init_kwargs": {"num_cpus": 8},
                                                                      "options": {ROLLOUT_SHARD: {"num_gpus": 1}}}})
    assert old == new and old.runner("rollout").shards == 4
    assert new.ray.options[ROLLOUT_SHARD] == {"num_gpus": 1}


def test_old_keys_at_their_old_defaults_say_nothing():
    """A config dumped before the rename carries every key at its default: it loads silently,
    as the default config."""
    dumped = TrainConfig().model_dump(mode="json")
    dumped.pop("ray")
    dumped["orchestration"].update(ray_address=None, ray_init_kwargs={}, worker_options={})
    dumped["runners"] = {"rollout": {"mode": "inprocess", "shards": 1, "ray_address": None, "ray_init_kwargs": {},
                                     "ray_remote_options": {}, "workers": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKeyWarning)
        cfg = TrainConfig.model_validate(dumped)
    assert cfg.ray == TrainConfig().ray and cfg.orchestration == TrainConfig().orchestration
    # keep_models: orchestration.keep_models at its default (auto: on with the HF engine)
    assert cfg.runner("rollout") == config_package.RunnerConfig(mode="inprocess", shards=1, keep_models=True)


def test_a_dumped_config_round_trips_without_warnings():
    cfg = load_config("configs/grpo_scale.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKeyWarning)
        assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    resident = load_config(None, {**RESIDENT, "ray.options": {"rollout": {"num_gpus": 2}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKeyWarning)
        assert TrainConfig.model_validate(resident.model_dump(mode="json")) == resident


@pytest.mark.parametrize("overrides, names", [
    ({"orchestration.ray_address": "auto", "ray.address": "ray://head:10001"},
     ["orchestration.ray_address='auto'", "ray.address='ray://head:10001'", "give ray.address two values"]),
    ({"orchestration.ray_init_kwargs": {"num_cpus": 2}, "runners.rollout.ray_init_kwargs": {"num_cpus": 4}},
     ["orchestration.ray_init_kwargs={'num_cpus': 2}", "runners.rollout.ray_init_kwargs={'num_cpus': 4}",
      "give ray.init_kwargs two values"]),
    ({**_resident_runner(), "orchestration.workers": "stage"},
     ["runners.ppo_update.mode=resident and orchestration.workers='stage'",
      "give orchestration.workers two values"]),
    ({"runners.rollout.ray_remote_options": {"num_gpus": 1}, "ray.options": {ROLLOUT_SHARD: {"num_gpus": 2}}},
     ["runners.rollout.ray_remote_options={'num_gpus': 1}", "ray.options.rollout_shard={'num_gpus': 2}"]),
])
def test_two_values_for_one_setting_are_refused_naming_both_keys(overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_an_old_key_that_agrees_with_the_new_one_loads():
    with pytest.warns(DeprecatedKeyWarning, match="orchestration.ray_address is deprecated"):
        cfg = load_config(None, {"orchestration.ray_address": "auto", "ray.address": "auto"})
    assert cfg.ray.address == "auto"


def test_an_unknown_key_of_the_old_workers_section_is_refused():
    with pytest.raises(ConfigError, match=r"runners.ppo_update.workers.gpus: not a setting"):
        load_config(None, _resident_runner(gpus=1))


def test_ray_options_name_known_roles():
    with pytest.raises(ConfigError, match=r"ray.options: .*unknown role\(s\) \['refrence'\]; valid names: policy, "
                                          r"rollout, reference, critic, teacher, rollout_shard"):
        load_config(None, {"ray.options": {"refrence": {"num_gpus": 1}}})
    from rft_core.workers.pool import ROLES

    assert set(RAY_ROLES) == set(ROLES)


def test_the_one_ray_section_reaches_the_resident_workers():
    from rft_core.workers.pool import actor_options

    cfg = load_config(None, {**RESIDENT, "ray": {"address": "ray://head:10001", "init_kwargs": {"num_cpus": 4},
                                                  "options": {"reference": {"num_gpus": 0.5},
                                                              ROLLOUT_SHARD: {"num_gpus": 1}}}})
    for stage in ("rollout", "ref_logprobs", "ppo_update"):
        workers = cfg.runner(stage).workers
        assert workers.ray is cfg.ray  # the section itself, not a copy of its fields
        assert workers.ray.address == "ray://head:10001" and workers.ray.init_kwargs == {"num_cpus": 4}
        # each worker gets its role's options; the fan-out's shard tasks are not a worker
        assert actor_options(workers, "reference", cluster_gpus=0) == {"num_cpus": 0, "num_gpus": 0.5}
        assert actor_options(workers, "rollout", cluster_gpus=0) == {"num_cpus": 0}


def test_every_preset_uses_the_new_keys():
    for preset in sorted(Path("configs").glob("*.yaml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecatedKeyWarning)
            load_config(preset)


def test_the_config_defines_one_ray_address_field():
    """The Ray address has one home: ``ray.address``; the resident pool's runtime object holds
    the ``ray`` section itself (``WorkersConfig.ray``, built by ``TrainConfig.runner``)."""
    models = {cls for module in (config_package, *[m for _, m in inspect.getmembers(config_package, inspect.ismodule)
                                                   if m.__name__.startswith("rft_core.config")])
              for _, cls in inspect.getmembers(module, inspect.isclass)
              if issubclass(cls, BaseModel) and cls.__module__.startswith("rft_core.config")}
    assert [cls.__name__ for cls in models if {"ray_address", "address"} & set(cls.model_fields)] == ["RayConfig"]
    assert config_package.WorkersConfig.model_fields["ray"].annotation is config_package.RayConfig
    # the sections a user writes hold no Ray setting of their own any more
    assert not {"ray_address", "ray_init_kwargs", "ray_remote_options"} & set(config_package.RunnerConfig.model_fields)
    assert not {"ray_address", "ray_init_kwargs", "worker_options"} & set(config_package.OrchestrationConfig.model_fields)
