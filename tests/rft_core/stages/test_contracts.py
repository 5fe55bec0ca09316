"""Stage contracts: config hashes by field name (order and defaulted additions do not matter),
the defaults every hash relies on pinned, runs of another contract refused as another version."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field

from rft_core.config import (
    ADVANTAGE_CONFIGS,
    DEFAULT_JUDGE_TEMPLATE,
    POLICY_LOSS_CONFIGS,
    REWARD_SOURCE_CONFIGS,
    KLConfig,
    PPOClipLoss,
    RolloutConfig,
    TrainConfig,
    UpdateConfig,
)
from rft_core.config.rewards import DEFAULT_SCORE_PATTERN
from rft_core.stages.common import stage_commit
from rft_core.stages.contracts import STAGE_INPUTS, PPOUpdateInput, RolloutInput, StageInput, hash_value
from rft_core.stages.runner import INPUTS, PROGRAMS
from schemas import OlderVersionError, ShardRef, StaleShardError, write_shard
from schemas.columns import PROMPTS

REF = ShardRef(uri="memory://x/p", stage="prompts", num_rows=1, config_hash="h", manifest_sha256="a" * 64)


class _Ordered(StageInput):
    program: ClassVar[str] = "demo"
    stage: ClassVar[str] = "demo"
    prompts: ShardRef
    iteration: int
    temperature: float = 1.0


class _Reordered(StageInput):  # the same fields in another order, plus a new defaulted one
    program: ClassVar[str] = "demo"
    stage: ClassVar[str] = "demo"
    temperature: float = 1.0
    iteration: int
    prompts: ShardRef
    new_option: bool = Field(False)


def test_hash_is_by_field_name_and_ignores_order_and_new_defaults():
    a = _Ordered(prompts=REF, iteration=3, out="o1")
    b = _Reordered(iteration=3, prompts=REF, out="o2")
    assert a.config_hash() == b.config_hash()  # `out` is not hashed either
    assert _Reordered(iteration=3, prompts=REF, out="o", new_option=True).config_hash() != a.config_hash()
    assert _Ordered(prompts=REF, iteration=3, temperature=0.5, out="o").config_hash() != a.config_hash()
    # the canonical text: contract id, then the non-default fields by name
    text = json.dumps(["demo v1", {"iteration": 3, "prompts": {"shard": "a" * 64}}, {}], sort_keys=True, separators=(",", ":"))
    assert a.config_hash() == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_nested_configs_hash_their_non_default_fields_and_type():
    assert hash_value(RolloutConfig()) == {"type": "RolloutConfig"}
    assert hash_value(RolloutConfig(temperature=0.7)) == {"type": "RolloutConfig", "temperature": 0.7}
    # two losses whose fields are all defaults still differ by type
    gspo = UpdateConfig.model_validate({"policy_loss": {"name": "gspo"}})
    dual = UpdateConfig.model_validate({"policy_loss": {"name": "dual_clip"}})
    assert hash_value(gspo) != hash_value(dual) and "policy_loss" not in hash_value(UpdateConfig(policy_loss=PPOClipLoss()))
    base = dict(prompts=REF, policy="p", rollout=RolloutConfig(), iteration=1, out="o")
    assert RolloutInput(**base).config_hash() == RolloutInput(**base, dtype="float32", attempt=0).config_hash()
    assert RolloutInput(**base).config_hash() != RolloutInput(**{**base, "iteration": 2}).config_hash()
    assert RolloutInput(**base, shard=(0, 2)).config_hash() != RolloutInput(**base).config_hash()
    with pytest.raises(ValueError, match="shard index 2 is not in 0..1"):
        RolloutInput(**base, shard=(2, 2))


def test_the_update_hashes_ref_logprobs_only_when_the_kl_is_a_loss_term():
    base = dict(rollout=REF, advantages=REF, policy="p", update=UpdateConfig(), temperature=1.0, out="o")
    in_reward = KLConfig(kl_coef=0.1, mode="reward")
    assert (PPOUpdateInput(**base, kl=in_reward, ref_logprobs=REF).config_hash()
            == PPOUpdateInput(**base, kl=in_reward).config_hash())
    in_loss = KLConfig(kl_coef=0.1, mode="loss", estimator="k2")
    assert (PPOUpdateInput(**base, kl=in_loss, ref_logprobs=REF).config_hash()
            != PPOUpdateInput(**base, kl=in_loss).config_hash())
    # how the optimizer state is written is not part of what is computed
    assert (PPOUpdateInput(**base, kl=in_reward, background_optimizer=True).config_hash()
            == PPOUpdateInput(**base, kl=in_reward).config_hash())
    # nor where a checkpoint's weights are written (its folder, or the background sibling ppo_update-policy)
    assert (PPOUpdateInput(**base, kl=in_reward, background_checkpoint=True).config_hash()
            == PPOUpdateInput(**base, kl=in_reward).config_hash())


def test_every_program_has_one_input_model_and_every_input_model_a_program():
    assert set(INPUTS) == set(PROGRAMS)
    # the two stages a ppo_update writes itself (its AdamW state, a background checkpoint's weights) have no program
    assert {cls.program for cls in STAGE_INPUTS} == set(PROGRAMS) | {"optimizer_state", "policy_checkpoint"}
    for cls in STAGE_INPUTS:
        for name, path in cls.config_paths.items():
            assert name in cls.model_fields, (cls.__name__, name)
            first = path.split(".")[0]
            assert first in TrainConfig.model_fields or hasattr(TrainConfig, first), (cls.__name__, path)


def test_a_run_written_by_another_contract_is_refused_as_another_version(tmp_path):
    import pyarrow as pa

    row = {"prompt_id": "p-0", "data_source": "t", "question": "q", "prompt_text": "q", "prompt_token_ids": [1],
           "answer": "1", "metadata_json": "{}", "images": [], "videos": []}
    table = pa.Table.from_pylist([row], schema=PROMPTS.arrow)
    inp = _Ordered(prompts=REF, iteration=1, out=str(tmp_path / "old"))
    write_shard(table, inp.out, schema=PROMPTS, config_hash="0123456789abcdef")  # no contract: an older version
    commit = stage_commit(inp, stage="prompts")
    with pytest.raises(OlderVersionError, match="written by an older version of prefect-rft .*stage contract none; "
                                                "this version writes demo v1"):
        commit.committed()
    # same contract, other config: the usual refusal, naming both hashes
    write_shard(table, str(tmp_path / "same"), schema=PROMPTS, config_hash="0123456789abcdef", contract="demo v1")
    with pytest.raises(StaleShardError, match="config hash 0123456789abcdef") as info:
        stage_commit(inp, uri=str(tmp_path / "same"), stage="prompts").committed()
    assert not isinstance(info.value, OlderVersionError)


# The default of every config field, as committed runs were hashed with them. Hashes leave
# defaults out, so a default that changes would silently change what an old hash means: when
# this test fails, bump ``version`` of every stage input whose config reads the changed field
# (rft_core/stages/contracts.py), then rewrite the snapshot (``python -m
# tests.rft_core.stages.test_contracts``). New fields are fine: a new field at its default
# leaves every hash as it was.
SNAPSHOT = Path(__file__).with_name("config_defaults.json")


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}


def current_defaults() -> dict:
    defaults = _flat(TrainConfig().model_dump(mode="json", exclude={"run_root", "name"}))
    # every advantage estimator's and policy loss's own defaults, not only the default choice's
    # ("advantage[gae].whiten"): a config of another estimator hashes without its defaults too
    for cls in ADVANTAGE_CONFIGS:
        defaults.update(_flat(cls().model_dump(mode="json"), f"advantage[{cls().estimator}]."))
    for cls in POLICY_LOSS_CONFIGS:
        defaults.update(_flat(cls().model_dump(mode="json"), f"update.policy_loss[{cls().name}]."))
    # every reward source type's defaults ("reward.sources[llm_judge].max_tokens"; required fields
    # have none): a source hashes without its defaults too
    for cls in REWARD_SOURCE_CONFIGS:
        for name, field in cls.model_fields.items():
            if not field.is_required():
                value = json.loads(json.dumps(field.get_default(call_default_factory=True)))  # tuples as lists
                defaults[f"reward.sources[{cls.model_fields['type'].default}].{name}"] = value
    # what the llm_judge's template: null and pattern: null stand for (the default rubric and score pattern)
    for name, text in (("template", DEFAULT_JUDGE_TEMPLATE), ("pattern", DEFAULT_SCORE_PATTERN)):
        defaults[f"reward.sources[llm_judge].{name}=null sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return defaults


def test_config_defaults_are_pinned():
    pinned, now = json.loads(SNAPSHOT.read_text()), current_defaults()
    changed = {k: (v, now.get(k, "<removed>")) for k, v in pinned.items() if now.get(k, "<removed>") != v}
    assert not changed, (f"config defaults changed {changed}: bump the version of the stage contracts that read them, "
                         "then rewrite the snapshot (python -m tests.rft_core.stages.test_contracts)")
    unpinned = sorted(set(now) - set(pinned))  # a new setting is pinned when it is added, not sessions later
    assert not unpinned, (f"new config defaults {unpinned}: pin them (python -m tests.rft_core.stages.test_contracts) "
                          "once they enter no committed stage's hash at their default")


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current_defaults(), indent=1, sort_keys=True) + "\n")
