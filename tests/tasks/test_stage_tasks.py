"""The task bodies, called as plain functions (``.fn``) outside any flow: each runs its stage
program on the input model it is given and returns what the program committed."""
from __future__ import annotations

import pytest

import tasks
from rft_core.api import AdvantagesInput, PromptsInput, RewardsInput, RolloutInput
from rft_core.config import CheckpointConfig, RunnerConfig, load_config
from schemas import ShardRef, read_manifest, read_shard, stage_uri
from tests.flows.conftest import _fake_score


@pytest.fixture
def cfg(tiny_model, monkeypatch):
    monkeypatch.setattr("rft_core.rewards.math.score_response", _fake_score)
    return load_config(None, {"policy.path": tiny_model, "data.prompts_per_iteration": 2, "data.size": 20,
                              "rollout.n_samples_per_prompt": 2, "rollout.max_new_tokens": 4, "rollout.batch_size": 4})


def test_task_bodies_run_their_stage_programs(cfg, tiny_model, tmp_path):
    root = str(tmp_path / "run")

    def out(stage):
        return stage_uri(root, 1, stage)

    p = tasks.prompts.fn(inp=PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1, out=out("prompts")))
    assert isinstance(p, ShardRef) and p.stage == "prompts" and p.num_rows == 2
    r_inp = RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=out("rollout"))
    r = tasks.rollout.fn(inp=r_inp)
    assert r.num_rows == 4 and read_manifest(r.uri)[0].contract == f"rollout v{RolloutInput.version}"
    assert tasks.rollout.fn(inp=r_inp) == r  # committed: reused, not recomputed
    w = tasks.rewards.fn(inp=RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=out("rewards")))
    assert sorted(read_shard(w).column("rewards").to_pylist()) == sorted(
        _fake_score(t).reward for t in read_shard(r).column("response_text").to_pylist())
    assert tasks.signal_groups.fn(attempt_rewards=[w]) == len({
        pid for pid, rs in _groups(w).items() if len(set(rs)) > 1})
    a = tasks.advantages.fn(inp=AdvantagesInput(rollout=r, rewards=w, kl=cfg.kl, advantage=cfg.advantage,
                                                state=cfg.initial_state, out=out("advantages")))
    assert a.num_rows == 4 and "next_state" in read_manifest(a.uri)[0].summary
    assert tasks.prune_checkpoints.fn(run_root=root, iteration=1, checkpoint=CheckpointConfig()) == {}


def _groups(rewards: ShardRef) -> dict[str, list[float]]:
    t = read_shard(rewards)
    out: dict[str, list[float]] = {}
    for pid, rw in zip(t.column("prompt_id").to_pylist(), t.column("rewards").to_pylist()):
        out.setdefault(pid, []).append(rw)
    return out


def test_a_runner_moves_the_program_into_a_subprocess(cfg, tiny_model, tmp_path):
    p = tasks.prompts.fn(inp=PromptsInput(data=cfg.data, tokenizer_path=tiny_model, iteration=1,
                                          out=str(tmp_path / "prompts")))
    inp = RolloutInput(prompts=p, policy=tiny_model, rollout=cfg.rollout, iteration=1, out=str(tmp_path / "a"))
    here = tasks.rollout.fn(inp=inp)
    there = tasks.rollout.fn(inp=inp.model_copy(update={"out": str(tmp_path / "b")}), runner=RunnerConfig(mode="subprocess"))
    assert there.config_hash == here.config_hash
    assert [f.checksum for f in read_manifest(there.uri)[0].files] == [f.checksum for f in read_manifest(here.uri)[0].files]
