"""A tiny task whose rewards vary between the samples of a group (issue 39): the setting every
equality test of two modes runs on, so that advantages are not all zero and the policy gradient is
not 0 (with the default reward the tiny random model, ``tests/tiny.py``, never answers right:
every reward is 0, every GRPO advantage 0, and the weights move only through the KL term).

API (import from ``tests.varying``)
-----------------------------------
``VARYING_REWARD``
    ``"tests.varying:token_reward"``, the ``module:function`` of the reward (a ``python``
    reward source, ``rft_core/rewards/user.py``). Importable in every process a run starts: the
    flow in pytest, the CLI subprocesses of ``tests/faults.py`` (``PYTHONPATH`` = the repository
    root), the resident workers (the rewards stage runs in the driver).
``token_reward(sample) -> float``
    ``(crc32(response text) mod 5) / 4``, one of 0, 0.25, 0.5, 0.75, 1: a deterministic function
    of the sampled tokens (their decoded text), so a rerun, a resumed run and another mode on the
    same tokens score alike, and any change of a response changes its reward.
``REWARD``
    The config overrides (the mapping form of ``rft_core.config.load_config``) that make
    ``token_reward`` the reward of every dataset label: ``load_config(None, {**REWARD, ...})``
    or ``flow_cfg(model, root, **REWARD)``.
``reward_args() -> list[str]``
    The same as ``key=value`` strings (the list form: ``load_config(None, [*reward_args(), ...])``).
``REWARD_YAML``
    The same as a ``reward:`` block to append to a YAML config file (``tests/faults.py``).
``varying_config(model, run_root, *extra, iterations=2) -> TrainConfig``
    A small training config with the varying reward: 3 prompts x 4 samples, 8 new tokens,
    GRPO, KL 0.05 in the loss, 2 epochs of micro-batches of 4; ``extra``: more ``key=value``
    overrides (they win).
``assert_advantages_vary(run_root, iteration=1) -> float``
    Reads the COMMITTED ``rewards`` and ``advantages`` shards of ``iteration`` under
    ``run_root`` (a folder or any fsspec URI) and asserts that the rewards differ inside at least
    one group and that some advantage is not 0 (|A| > 1e-3); returns max |A|. Call it FIRST in an
    equality test, before comparing weights.
``assert_policy_loss_nonzero(run_root, iteration=1) -> float``
    Reads the committed ``ppo_update`` shard (one row per optimizer step) and asserts that some
    step's ``grad_norm`` exceeds 1e-3 (with all-zero advantages only the KL term pushes: ~4e-6 on
    the tiny model in iteration 1) and, when the update took more than one step, that some step's
    ``policy_loss`` is not 0 (|loss| > 1e-6); returns max |loss|. (The loss VALUE of an on-policy
    first step is -sum(A) / tokens, exactly 0 for group-normalised advantages of equal-length
    responses whatever the advantages are; its gradient is not 0.)
``assert_update_signal(update_uri) -> float``
    The same on a ``ppo_update`` shard given by its folder's URI (or ``ShardRef``), for updates
    outside a run layout.
``assert_shard_advantages_nonzero(advantages_uri) -> float``
    ``assert_advantages_vary``'s advantage check on an ``advantages`` shard given by its URI.
``assert_training_signal(run_root, iterations) -> None``
    ``assert_advantages_vary`` and ``assert_policy_loss_nonzero`` for each iteration in
    ``iterations``: the one call an equality test of two modes makes first.
``policy_weights(ref_or_uri) -> dict[str, Tensor]``
    The stored weights of a committed update (a ``ShardRef`` or its folder's URI), LoRA merged.
``assert_weights_moved(run_root, iteration, initial_model, atol=1e-4) -> float``
    Asserts that the stored policy of ``iteration`` differs from ``initial_model``'s weights by
    more than ``atol`` somewhere; returns the largest difference.

The reward and the checks are tested on hand-made shards in ``tests/test_varying.py``.
"""
from __future__ import annotations

import json
import zlib
from collections import defaultdict
from typing import Any, Iterable

VARYING_REWARD = "tests.varying:token_reward"

REWARD: dict[str, Any] = {
    "reward.sources": {"varying": {"type": "python", "function": VARYING_REWARD}},
    "reward.recipes": {"varying": [{"source": "varying", "weight": 1.0}]},
    "reward.default_recipe": "varying",
}

REWARD_YAML = f"""reward:
  sources: {{varying: {{type: python, function: "{VARYING_REWARD}"}}}}
  recipes: {{varying: [{{source: varying, weight: 1.0}}]}}
  default_recipe: varying
"""

SMALL = ["data.prompts_per_iteration=3", "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
         "rollout.batch_size=12", "kl.kl_coef=0.05", "update.lr=1e-3", "update.micro_batch_size=4", "update.epochs=2"]


def token_reward(sample) -> float:
    """(crc32 of the response text mod 5) / 4: a reward in {0, 0.25, 0.5, 0.75, 1} that depends
    only on the sampled tokens (``sample``: ``rft_core.rewards.base.RewardSample``)."""
    return (zlib.crc32(sample.response.encode("utf-8")) % 5) / 4


def reward_args() -> list[str]:
    """``REWARD`` as ``key=value`` overrides (values as JSON, which the override parser reads as YAML)."""
    return [f"{k}={json.dumps(v)}" for k, v in REWARD.items()]


def varying_config(model: str, run_root, *extra: str, iterations: int = 2):
    """A small ``TrainConfig`` on ``model`` under ``run_root`` whose rewards vary (see the module doc)."""
    from rft_core.config import load_config

    return load_config(None, [*SMALL, *reward_args(), f"iterations={iterations}", f"policy.path={model}",
                              f"run_root={run_root}", *extra])


def _shard(run_root, iteration: int, stage: str):
    from schemas import read_shard, stage_uri

    return read_shard(stage_uri(str(run_root).rstrip("/"), iteration, stage), stage=stage)


def assert_shard_advantages_nonzero(advantages) -> float:
    """Assert that some advantage of the committed ``advantages`` shard (``ShardRef`` or folder
    URI) is not 0 (|A| > 1e-3); returns max |A| over every response token."""
    from schemas import read_shard

    adv = read_shard(advantages, stage="advantages").column("advantages").to_pylist()
    biggest = max((abs(a) for row in adv for a in row), default=0.0)
    assert biggest > 1e-3, f"{getattr(advantages, 'uri', advantages)}: every advantage is 0 (max |A| = {biggest})"
    return biggest


def assert_advantages_vary(run_root, iteration: int = 1) -> float:
    """Assert that the committed rewards of ``iteration`` differ inside some group and that its
    committed advantages are not all 0; returns max |advantage| (over every response token).

    Raises:
        AssertionError: every group's rewards are equal, or every advantage is 0 (within 1e-3).
        schemas.ShardNotCommittedError: the stage has no manifest.
    """
    rewards = _shard(run_root, iteration, "rewards")
    groups: dict[str, set[float]] = defaultdict(set)
    for pid, r in zip(rewards.column("prompt_id").to_pylist(), rewards.column("rewards").to_pylist()):
        groups[pid].add(r)
    assert any(len(v) > 1 for v in groups.values()), (
        f"iteration {iteration} of {run_root}: every group's rewards are equal ({dict(groups)}): no learning signal")
    from schemas import stage_uri

    return assert_shard_advantages_nonzero(stage_uri(str(run_root).rstrip("/"), iteration, "advantages"))


def assert_update_signal(update) -> float:
    """Assert that some optimizer step of the committed ``ppo_update`` shard ``update``
    (``ShardRef`` or folder URI) had a gradient norm above 1e-3 and, for an update of more than
    one step, a policy loss that is not 0; returns max |policy_loss| over its steps.

    The loss value of an on-policy first step (ratio 1) is -sum(A) / tokens: exactly 0 for
    group-normalised advantages of equal-length responses however large they are, so one step's
    loss proves nothing; its gradient does. Later steps (ratio != 1) have a non-zero loss.

    Raises:
        AssertionError: every gradient norm is at most 1e-3 (what the KL term alone gives with
            all-zero advantages: ~4e-6 in the tiny model's first iteration), or the update took
            several steps and each one's policy loss is 0 (within 1e-6).
    """
    from schemas import read_shard

    table = read_shard(update, stage="ppo_update")
    losses, norms = table.column("policy_loss").to_pylist(), table.column("grad_norm").to_pylist()
    where = getattr(update, "uri", update)
    assert max(norms, default=0.0) > 1e-3, f"{where}: no step had a gradient norm above 1e-3 ({norms})"
    biggest = max((abs(x) for x in losses), default=0.0)
    assert len(losses) < 2 or biggest > 1e-6, f"{where}: policy_loss is 0 in every step ({losses})"
    return biggest


def assert_policy_loss_nonzero(run_root, iteration: int = 1) -> float:
    """``assert_update_signal`` on the committed ``ppo_update`` shard of ``iteration``."""
    from schemas import stage_uri

    return assert_update_signal(stage_uri(str(run_root).rstrip("/"), iteration, "ppo_update"))


def assert_training_signal(run_root, iterations: Iterable[int]) -> None:
    """``assert_advantages_vary`` and ``assert_policy_loss_nonzero`` for each iteration."""
    for it in iterations:
        assert_advantages_vary(run_root, it)
        assert_policy_loss_nonzero(run_root, it)


def policy_weights(ref) -> dict:
    """The stored policy weights of a committed update (``ShardRef`` or its folder's URI) as
    float tensors by name; a LoRA adapter checkpoint is merged into its base model."""
    from rft_core.models.loading import load_causal_lm
    from rft_core.stages.checkpoints import policy_model_path
    from schemas import ShardRef

    ref = ref if isinstance(ref, ShardRef) else ShardRef.from_manifest(str(ref))
    return {k: v.detach().float() for k, v in load_causal_lm(policy_model_path(ref)).state_dict().items()}


def assert_weights_moved(run_root, iteration: int, initial_model: str, atol: float = 1e-4) -> float:
    """Assert that the stored policy of ``iteration`` moved away from ``initial_model`` by more
    than ``atol`` in some weight; returns the largest absolute difference."""
    from rft_core.models.loading import load_causal_lm
    from schemas import stage_uri

    after = policy_weights(stage_uri(str(run_root).rstrip("/"), iteration, "ppo_update"))
    before = {k: v.detach().float() for k, v in load_causal_lm(initial_model).state_dict().items()}
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert moved > atol, f"iteration {iteration} of {run_root}: the weights did not move (max |dW| = {moved})"
    return moved
