"""The rollout manifest's ``policy_version`` and ``staleness`` (what the iteration's metrics read,
``rft_core.metrics``) survive every merge of rollout shards (issue 39): the fan-out's
``rollout_merge`` of its shards and dynamic sampling's merge of its attempts. The shards here are
made in this process (the Ray fan-out's own test, tests/flows/test_ray_fanout.py, runs them on
Ray workers)."""
from __future__ import annotations

import pyarrow as pa
import pytest

from rft_core.stages import dynamic
from rft_core.stages import prompts as prompts_stage
from rft_core.stages import rollout as rollout_stage
from rft_core.stages.contracts import DynamicMergeInput, PromptsInput, RolloutInput, RolloutMergeInput
from schemas import read_manifest, read_shard, write_shard
from schemas.columns import REWARDS
from tests.flows.conftest import flow_cfg

# iteration 3 of a run with rollout.max_staleness 1 samples with the policy of update 1: staleness 1
ITERATION, VERSION = 3, 1
VERSIONS = {"policy_version": VERSION, "staleness": 1}


@pytest.fixture(scope="module")
def stale(tiny_model, tmp_path_factory):
    """The prompts and the rollout input of a stale iteration (4 prompts x 2 samples in 2 engine
    batches) and the single-worker rollout."""
    root = tmp_path_factory.mktemp("stale")
    cfg = flow_cfg(tiny_model, root / "run", **{"data.prompts_per_iteration": 4, "rollout.n_samples_per_prompt": 2,
                                                "rollout.batch_size": 4, "rollout.max_new_tokens": 4})
    prompts = prompts_stage.run(PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=ITERATION,
                                             out=str(root / "prompts")))
    inp = RolloutInput(prompts=prompts, policy=tiny_model, rollout=cfg.rollout, iteration=ITERATION,
                       policy_version=VERSION, out=str(root / "single"))
    return root, prompts, inp, rollout_stage.run(inp)


def _versions(ref) -> dict:
    summary = read_manifest(ref.uri)[0].summary
    return {k: summary[k] for k in VERSIONS}


def test_the_fanout_merge_keeps_policy_version_and_staleness(stale):
    root, prompts, inp, single = stale
    assert _versions(single) == VERSIONS
    out = str(root / "fanout")
    parts = [rollout_stage.run(inp.model_copy(update={"shard": (i, 2), "out": f"{out}-shard{i}"})) for i in range(2)]
    assert [p.num_rows for p in parts] == [4, 4] and all(_versions(p) == VERSIONS for p in parts)
    merged = rollout_stage.run_merge(RolloutMergeInput(rollout=inp.model_copy(update={"out": out}), parts=parts, out=out))
    assert merged.config_hash == single.config_hash and _versions(merged) == VERSIONS
    m, _ = read_manifest(merged.uri)
    assert m.inputs["prompts"] == read_manifest(prompts.uri)[1] and m.summary["shards"] == 2
    # a shard of the rollout sampled with another policy version is refused, by name
    other = rollout_stage.run(inp.model_copy(update={"shard": (1, 2), "policy_version": 0, "out": f"{out}-v0-shard1"}))
    with pytest.raises(ValueError, match=r"v0-shard1 was sampled with policy version 0, the merged rollout with 1"):
        rollout_stage.run_merge(RolloutMergeInput(rollout=inp.model_copy(update={"out": f"{out}-bad"}),
                                                  parts=[parts[0], other], out=f"{out}-bad"))


def _rewards(rollout, uri: str):
    """Rewards that differ inside every group (sample k gets k), so dynamic sampling keeps them all."""
    t = read_shard(rollout, stage="rollout")
    n = t.num_rows
    table = pa.table({"sample_id": t.column("sample_id"), "prompt_id": t.column("prompt_id"),
                      "rewards": pa.array([float(k) for k in t.column("sample_index").to_pylist()], pa.float32()),
                      "correct": [False] * n, "extracted_answer": pa.array([None] * n, pa.string()),
                      "reward_metrics": pa.array([[]] * n, pa.map_(pa.string(), pa.float32())),
                      "reward_reasons": pa.array([[]] * n, pa.map_(pa.string(), pa.string()))}, schema=REWARDS.arrow)
    return write_shard(table, uri, schema=REWARDS, config_hash=uri)


def test_the_dynamic_sampling_merge_keeps_policy_version_and_staleness(stale):
    root, prompts, inp, single = stale
    rewards = _rewards(single, str(root / "rewards"))
    # attempt 1: a refill rollout of the same iteration and policy (its own seed)
    refill = rollout_stage.run(inp.model_copy(update={"attempt": 1, "out": str(root / "rollout-try1")}))
    attempts = [(prompts, single, rewards), (prompts, refill, _rewards(refill, str(root / "rewards-try1")))]
    outs = {"out": str(root / "m-prompts"), "out_rollout": str(root / "m-rollout"), "out_rewards": str(root / "m-rewards")}
    _, rollout, _ = dynamic.run_merge(DynamicMergeInput(attempts=attempts, target_groups=4, **outs))
    assert rollout.num_rows == 8 and _versions(rollout) == VERSIONS
    # attempts that disagree on the policy they were sampled with cannot be one iteration's rollout
    stale0 = rollout_stage.run(inp.model_copy(update={"attempt": 1, "policy_version": 0, "out": str(root / "v0-try1")}))
    mixed = [attempts[0], (prompts, stale0, _rewards(stale0, str(root / "v0-rewards-try1")))]
    outs = {k: v + "-mixed" for k, v in outs.items()}
    with pytest.raises(ValueError, match=r"different \(policy_version, staleness\): \(1, 1\) in .*, \(0, 2\) in .*v0-try1"):
        dynamic.run_merge(DynamicMergeInput(attempts=mixed, target_groups=4, **outs))


def test_rollout_versions_by_hand():
    assert dynamic.rollout_versions([{"policy_version": 2, "staleness": 0, "seconds": 1.0}] * 2, ["a", "b"]) == {
        "policy_version": 2, "staleness": 0}
    assert dynamic.rollout_versions([{"seconds": 1.0}], ["a"]) == {}  # manifests written before issue 28
    with pytest.raises(ValueError, match=r"\(2, 0\) in a, \(1, 1\) in b"):
        dynamic.rollout_versions([{"policy_version": 2, "staleness": 0}, {"policy_version": 1, "staleness": 1}], ["a", "b"])
