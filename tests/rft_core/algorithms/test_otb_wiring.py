"""``advantage.estimator=optimal_token_baseline`` end to end: the actor pass's chunked
sum_v pi(v)^2 against a float64 softmax, the actor stage's optional ``sum_pi_squared`` column
(written only when asked, every existing hash and fingerprint as before), and a two-iteration
run whose committed advantages are verl's OTB recomputed in float64 from the committed shards."""
from __future__ import annotations

import pytest
import torch

from rft_core.algorithms import rollout_correction
from rft_core.algorithms.baselines import optimal_token_baseline_advantages
from rft_core.config import RolloutCorrectionConfig, load_config
from rft_core.models.logprobs import batched_response_logprobs, token_logprobs
from rft_core.stages.contracts import ActorLogprobsInput, AdvantagesInput
from schemas import ShardRef, read_manifest, read_shard, stage_uri
from schemas.batch import join_column_groups
from schemas.columns import ACTOR_LOGPROBS

D = torch.float64


def _sum_pi_squared64(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The float64 reference: the whole softmax of logits / temperature, squared and summed."""
    return torch.softmax(logits.to(D) / temperature, dim=-1).square().sum(-1)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_chunked_sum_pi_squared_is_the_full_softmax_squared(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 11, 97, generator=g, dtype=D) * 4
    logits[0, 0, 5] = 60.0  # one near-deterministic position (sum pi^2 -> 1)
    targets = torch.randint(0, 97, (3, 11), generator=g)
    want = _sum_pi_squared64(logits, temperature)
    lp0, ent0 = token_logprobs(logits, targets, temperature=temperature, with_entropy=True, chunk_size=7)
    for chunk in (1, 4, 7, 33, 1000):
        lp, ent, spi2 = token_logprobs(logits, targets, temperature=temperature, with_entropy=True, chunk_size=chunk,
                                       with_sum_pi_squared=True)
        assert spi2.shape == targets.shape and spi2.dtype == D
        torch.testing.assert_close(spi2, want, rtol=0, atol=1e-14)
        if chunk == 7:  # the other outputs are bit for bit those of a pass without it
            assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
        # without the entropy too; float32 and bfloat16 logits (the models' dtypes) in float32
        _, none, spi2b = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk, with_sum_pi_squared=True)
        assert none is None and torch.equal(spi2b, spi2)
        for dtype in (torch.float32, torch.bfloat16):  # float32 rounding of x - lse, |x| / T up to ~50 here
            low = logits.to(dtype)
            got = token_logprobs(low, targets, temperature=temperature, chunk_size=chunk, with_sum_pi_squared=True)[2]
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.to(D), _sum_pi_squared64(low, temperature), rtol=2e-5, atol=1e-7)
    assert len(token_logprobs(logits, targets)) == 2  # unchanged when not asked


def test_sum_pi_squared_is_data_not_a_differentiable_output():
    logits = torch.randn(5, 13, dtype=D, requires_grad=True)
    targets = torch.randint(0, 13, (5,))
    lp, ent, spi2 = token_logprobs(logits, targets, temperature=0.7, with_entropy=True, chunk_size=2,
                                   with_sum_pi_squared=True)
    assert not spi2.requires_grad and lp.requires_grad and ent.requires_grad
    (g,) = torch.autograd.grad((lp + ent).sum(), logits)
    lp0, ent0 = token_logprobs(logits, targets, temperature=0.7, with_entropy=True, chunk_size=2)
    (want,) = torch.autograd.grad((lp0 + ent0).sum(), logits)
    assert torch.equal(g, want)  # the gradients of the other outputs are untouched


def test_batched_pass_gives_each_response_tokens_sum_pi_squared(tiny_model):
    from rft_core.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model)
    with torch.no_grad():
        model.model.norm.weight.fill_(30.0)  # logits at a language model's scale, far from uniform
    for packing in (False, True):
        _check_batched_pass(model, packing)


def _check_batched_pass(model, packing: bool) -> None:
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[1, 2, 40], [3], [14, 15]]
    lp, ent, spi2 = batched_response_logprobs(model, prompts, responses, pad_token_id=2, micro_batch_size=2,
                                              temperature=0.8, with_entropy=True, packing=packing, chunk_size=2,
                                              with_sum_pi_squared=True)
    assert (lp, ent) == batched_response_logprobs(model, prompts, responses, pad_token_id=2, micro_batch_size=2,
                                                  temperature=0.8, with_entropy=True, packing=packing, chunk_size=2)
    lp2, none, spi2b = batched_response_logprobs(model, prompts, responses, pad_token_id=2, micro_batch_size=2,
                                                 temperature=0.8, packing=packing, with_sum_pi_squared=True)
    assert none is None and lp2 == lp and spi2b == spi2
    for p, r, got in zip(prompts, responses, spi2):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]  # the positions predicting r
        assert len(got) == len(r)
        torch.testing.assert_close(torch.tensor(got, dtype=D), _sum_pi_squared64(logits, 0.8), rtol=0, atol=1e-6)
        assert 0 < min(got) and max(got) <= 1


def _ref(stage: str) -> ShardRef:
    return ShardRef(uri=f"file:///r/{stage}", stage=stage, num_rows=1, config_hash="0" * 16, manifest_sha256=stage[0] * 64)


def _inputs(cfg) -> tuple[ActorLogprobsInput, AdvantagesInput]:
    actor = ActorLogprobsInput(rollout=_ref("rollout"), model=cfg.policy.path, logprobs=cfg.logprobs,
                               temperature=cfg.rollout.temperature, dtype=cfg.policy.dtype, grouping=cfg.logprob_grouping,
                               with_sum_pi_squared=cfg.needs_sum_pi_squared, out="file:///o")
    adv = AdvantagesInput(rollout=_ref("rollout"), rewards=_ref("rewards"), actor_logprobs=_ref("actor_logprobs"),
                          kl=cfg.kl, advantage=cfg.advantage, shaping=cfg.shaping, state=cfg.initial_state,
                          max_new_tokens=cfg.rollout.max_new_tokens, rollout_correction=cfg.advantage_rollout_correction,
                          out="file:///o")
    return actor, adv


def test_without_otb_every_hash_and_the_actor_schema_are_as_before():
    # the hashes of these inputs before the optimal token baseline existed (computed with the code of that commit);
    # the advantages contract is at v4 since issue 38 (OTB's handle_zero_tail default), which changed its hash from
    # 31c440e75907ebb2 (v3) to 5b223a2b7ae7d5ab for every config: committed v3 stages are refused, not reused
    before = {(): ("8970e94dbe9e21b4", "5b223a2b7ae7d5ab"), ("rollout.engine=vllm",): ("8970e94dbe9e21b4", "5b223a2b7ae7d5ab"),
              ("policy.dtype=bfloat16",): ("14e3b56fdc063caf", "5b223a2b7ae7d5ab")}
    for extra, hashes in before.items():
        cfg = load_config("configs/grpo_demo.yaml", list(extra))
        actor, adv = _inputs(cfg)
        assert "with_sum_pi_squared" not in actor.hash_view() and "rollout_correction" not in adv.hash_view()
        assert (actor.config_hash(), adv.config_hash()) == hashes, extra
    assert ACTOR_LOGPROBS.fingerprint == "8e20937072d94f86" and ACTOR_LOGPROBS.version == 1  # old shards still read
    cfg = load_config(None, ["advantage=optimal_token_baseline", "rollout.engine=vllm"])
    actor, adv = _inputs(cfg)
    assert cfg.kl.mode == "reward" and cfg.recomputes_old_logprobs and actor.hash_view()["with_sum_pi_squared"] is True
    assert adv.rollout_correction == cfg.update.rollout_correction and adv.rollout_correction.enabled
    assert "optimal_token_baseline" in " ".join(load_config(None, ["advantage=optimal_token_baseline"]).old_logprobs_blockers())


def parity_reward(sample) -> float:
    """A reward that varies within a group (a random model earns no task reward)."""
    return float(sum(map(ord, sample.response)) % 2)


@pytest.fixture(scope="module")
def otb_run(tiny_model, tmp_path_factory):
    from tests.drive import drive

    root = tmp_path_factory.mktemp("otb")
    cfg = load_config(None, [
        "advantage.estimator=optimal_token_baseline", "data.prompts_per_iteration=2", "data.size=50",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=10", "rollout.batch_size=8", "rollout.temperature=0.8",
        "kl.kl_coef=0.05", "update.lr=1e-2", "update.micro_batch_size=4", "iterations=2", f"policy.path={tiny_model}",
        f'reward.sources={{"parity": {{"type": "python", "function": "{__name__}:parity_reward"}}}}',
        'reward.recipes={"any": [{"source": "parity", "weight": 1.0}]}', "reward.default_recipe=any",
        f"run_root={root}"])
    drive(cfg)
    return cfg


@pytest.mark.parametrize("iteration", [1, 2])
def test_the_committed_advantages_are_otb_of_the_committed_shards_in_float64(otb_run, iteration):
    cfg = otb_run
    assert cfg.kl.mode == "reward" and cfg.kl.estimator == "k1"  # PAPER_KL_MODE: per-token KL rewards
    shards = {s: read_shard(stage_uri(cfg.run_root, iteration, s), stage=s)
              for s in ("rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages")}
    assert "sum_pi_squared" in shards["actor_logprobs"].column_names
    m, _ = read_manifest(stage_uri(cfg.run_root, iteration, "actor_logprobs"))
    assert m.schema_fingerprint == ACTOR_LOGPROBS.fingerprint
    b = join_column_groups(shards["rollout"], actor_logprobs=shards["actor_logprobs"], ref_logprobs=shards["ref_logprobs"],
                           rewards=shards["rewards"], advantages=shards["advantages"])
    mask = b.action_mask
    assert b.sum_pi_squared is not None and bool(((b.sum_pi_squared > 0) & (b.sum_pi_squared <= 1))[mask].all())
    old, ref, kl_coef = b.old_logprobs.to(D), b.ref_logprobs.to(D), read_manifest(
        stage_uri(cfg.run_root, iteration, "advantages"))[0].summary["kl_coef"]
    k1 = torch.where(mask, old - ref, torch.zeros_like(old)).clamp(-cfg.kl.kl_clamp, cfg.kl.kl_clamp)
    if iteration == 2:
        assert k1[mask].abs().max() > 1e-4  # the policy moved: the KL rewards take part
    last = torch.nn.functional.one_hot(b.response_length - 1, mask.shape[1]).to(D)
    token_rewards = -kl_coef * k1 + last * b.rewards.to(D)[:, None]
    groups = torch.unique(torch.tensor([hash(p) for p in b.prompt_id]), return_inverse=True)[1]
    want, want_ret = optimal_token_baseline_advantages(b.rewards.to(D), groups, mask, old_logprobs=old,
                                                       sum_pi_squared=b.sum_pi_squared.to(D), token_rewards=token_rewards)
    assert want[mask].abs().max() > 0.1
    torch.testing.assert_close(b.advantages.to(D), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(b.returns.to(D), want_ret, rtol=0, atol=2e-6)


def test_the_actor_stage_writes_the_column_only_when_asked_and_the_correction_weighs_it(otb_run, tmp_path):
    from rft_core.stages import advantages as adv_stage
    from rft_core.stages.runner import run_stage

    cfg = otb_run
    rollout = ShardRef.from_manifest(stage_uri(cfg.run_root, 1, "rollout"))
    asked = ShardRef.from_manifest(stage_uri(cfg.run_root, 1, "actor_logprobs"))
    plain = run_stage(ActorLogprobsInput(rollout=rollout, model=cfg.policy.path, logprobs=cfg.logprobs,
                                         temperature=cfg.rollout.temperature, out=str(tmp_path / "actor")))
    without, with_ = read_shard(plain), read_shard(asked)
    assert without.column_names == ["sample_id", "old_logprobs", "action_entropy"]
    assert with_.column_names == without.column_names + ["sum_pi_squared"]
    assert without.equals(with_.drop_columns(["sum_pi_squared"]))  # the rest bit for bit
    assert read_manifest(plain.uri)[0].schema_fingerprint == read_manifest(asked.uri)[0].schema_fingerprint
    from rft_core.models.loading import load_causal_lm  # the column: the initial policy's at rollout.temperature

    model, rollout_t = load_causal_lm(cfg.policy.path), read_shard(rollout)
    for row in range(2):
        p, r = rollout_t.column("prompt_token_ids")[row].as_py(), rollout_t.column("response_token_ids")[row].as_py()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        torch.testing.assert_close(torch.tensor(with_.column("sum_pi_squared")[row].as_py(), dtype=D),
                                   _sum_pi_squared64(logits, cfg.rollout.temperature), rtol=1e-4, atol=0)
    # without the column the advantages stage refuses the estimator, naming what to run
    rewards_t = read_shard(stage_uri(cfg.run_root, 1, "rewards"))
    batch = join_column_groups(rollout_t, actor_logprobs=without, rewards=rewards_t)
    with pytest.raises(ValueError, match="with_sum_pi_squared=true"):
        adv_stage.compute_advantages(batch, kl_cfg=cfg.kl.model_copy(update={"kl_coef": 0.0}), adv_cfg=cfg.advantage)
    # the rollout correction's weights (here of a perturbed engine) enter as rho_t^2
    batch = join_column_groups(rollout_t, actor_logprobs=with_, rewards=rewards_t)
    g = torch.Generator().manual_seed(0)
    batch.rollout_logprobs = batch.rollout_logprobs + 0.5 * torch.randn(batch.rollout_logprobs.shape, generator=g)
    rc = RolloutCorrectionConfig(enabled=True, cap=1.5)
    kl0 = cfg.kl.model_copy(update={"kl_coef": 0.0})
    got = adv_stage.compute_advantages(batch, kl_cfg=kl0, adv_cfg=cfg.advantage, correction=rc)["advantages"]
    mask = batch.action_mask
    w = rollout_correction(batch.old_logprobs, batch.rollout_logprobs, mask, mode="tis", cap=1.5).weights
    assert ((w < 1.5) & (w != 1) & mask).any()
    groups = torch.unique(torch.tensor([hash(p) for p in batch.prompt_id]), return_inverse=True)[1]
    want, _ = optimal_token_baseline_advantages(batch.rewards.to(D), groups, mask, old_logprobs=batch.old_logprobs.to(D),
                                                sum_pi_squared=batch.sum_pi_squared.to(D), rollout_is_weights=w.to(D))
    torch.testing.assert_close(got.to(D), want, rtol=0, atol=2e-6)
    plain_adv = adv_stage.compute_advantages(batch, kl_cfg=kl0, adv_cfg=cfg.advantage)["advantages"]
    assert (plain_adv - got).abs().max() > 1e-3


def test_sum_pi_squared_keeps_the_passes_memory_bound():
    """No (T, V) float32 tensor: the extra memory with sum pi^2 stays within the bound of the
    entropy pass (``test_chunked_logprobs``): a few (chunk, V) temporaries and the (N,) outputs."""
    from tests.rft_core.models.test_chunked_logprobs import _allocations, _random

    B, T, V, chunk = 4, 63, 8192, 4
    logits, targets = _random((B, T + 1), V, seed=6, dtype=torch.bfloat16)
    peak, largest = _allocations(lambda: token_logprobs(logits, targets, temperature=0.7, with_entropy=True,
                                                        chunk_size=chunk, with_sum_pi_squared=True))
    assert largest <= chunk * V * 4
    assert peak <= 3 * chunk * V * 4 + 5 * B * (T + 1) * 4
