"""DeepSpeed ZeRO 1/2/3 on CPU with 2 ranks (torchrun, gloo, torch AdamW), through the shared
training loop: the policy update's and the critic update's losses of every step and their final
weights match the single-process update on the same data."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

pytest.importorskip("deepspeed")

from rft_core.config import CriticConfig, DeepSpeedConfig, KLConfig, RunnerConfig, UpdateConfig  # noqa: E402
from rft_core.models.critic import load_critic  # noqa: E402
from rft_core.models.loading import load_causal_lm  # noqa: E402
from rft_core.models.logprobs import batched_response_logprobs  # noqa: E402
from rft_core.stages.contracts import CriticUpdateInput, PPOUpdateInput  # noqa: E402
from rft_core.stages.runner import run_stage  # noqa: E402
from schemas import read_manifest, read_shard, write_shard  # noqa: E402
from schemas.columns import ADVANTAGES, CRITIC_VALUES, ROLLOUT, single_turn_columns  # noqa: E402

RUNNER = RunnerConfig(mode="subprocess", launcher="torchrun", nproc_per_node=2, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def update_inputs(tiny_model, tmp_path_factory):
    """A rollout of 10 samples (old log-probs from the model itself) and +-1 advantages."""
    root = tmp_path_factory.mktemp("ds")
    g = torch.Generator().manual_seed(7)
    n = 10
    prompts = [torch.randint(3, 500, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 500, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    old = batched_response_logprobs(load_causal_lm(tiny_model), prompts, responses, pad_token_id=2)
    ids = [f"p{i // 2}#{i % 2}" for i in range(n)]
    rollout = pa.table({"sample_id": ids, "prompt_id": [s.split("#")[0] for s in ids], "sample_index": [i % 2 for i in range(n)],
                        "prompt_token_ids": prompts, "response_token_ids": responses, "response_text": [""] * n,
                        "rollout_logprobs": old, "action_mask": [[True] * len(r) for r in responses],
                        "finish_reason": ["length"] * n, "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)],
                        **single_turn_columns([""] * n)},
                       schema=ROLLOUT.arrow)
    adv = [[1.0 if i % 3 else -1.0] * len(r) for i, r in enumerate(responses)]
    advantages = pa.table({"sample_id": ids, "prompt_id": [s.split("#")[0] for s in ids], "shaped_rewards": [0.0] * n,
                           "kl": [[0.0] * len(r) for r in responses], "advantages": adv, "returns": adv},
                          schema=ADVANTAGES.arrow)
    r = write_shard(rollout, str(root / "rollout"), schema=ROLLOUT, config_hash="r")
    a = write_shard(advantages, str(root / "advantages"), schema=ADVANTAGES, config_hash="a")
    # 2 epochs of mini-batches of 5 in micro-batches of 2: 3 micro-batches per step over 2 ranks
    cfg = UpdateConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, max_grad_norm=1.0)
    single = run_stage(PPOUpdateInput(rollout=r, advantages=a, policy=tiny_model, update=cfg, kl=KLConfig(), temperature=1.0,
                                      out=str(root / "single")))
    return root, r, a, cfg, single


def _weights(uri):
    return load_causal_lm(f"{uri}/policy").state_dict()


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_two_ranks_match_single_process(update_inputs, tiny_model, zero_stage):
    root, r, a, cfg, single = update_inputs
    ds_cfg = cfg.model_copy(update={"deepspeed": DeepSpeedConfig(zero_stage=zero_stage)})
    lines: list[str] = []
    ref = run_stage(PPOUpdateInput(rollout=r, advantages=a, policy=tiny_model, update=ds_cfg, kl=KLConfig(), temperature=1.0,
                                   out=str(root / f"zero{zero_stage}")), RUNNER, log=lines.append)
    manifest, _ = read_manifest(ref.uri)
    assert manifest.summary["world_size"] == 2 and manifest.summary["zero_stage"] == zero_stage
    want = read_shard(single.uri).to_pydict()
    got = read_shard(ref.uri).to_pydict()
    assert got["num_tokens"] == want["num_tokens"] and len(got["step"]) == 4
    assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-5)
    assert got["approx_kl"] == pytest.approx(want["approx_kl"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert want["approx_kl"][-1] > 0  # the policy did move between steps
    w0, w1, init = _weights(single.uri), _weights(ref.uri), load_causal_lm(tiny_model).state_dict()
    moved = max((w0[k] - init[k]).abs().max().item() for k in w0)
    diff = max((w1[k] - w0[k]).abs().max().item() for k in w0)
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)  # 4 Adam steps of lr 1e-3 vs ~1e-6 rounding (measured)


def test_critic_update_under_zero2_on_two_ranks_matches_one_process(update_inputs, tiny_model):
    """The critic trains through the same loop and strategies as the policy: ZeRO-2 over 2 ranks
    gives the single-process critic's losses and weights."""
    root, r, a, _, _ = update_inputs
    rows = read_shard(r).to_pydict()
    # old values: a fresh critic's (zero head); targets: the advantage shard's returns (+-1)
    values = write_shard(pa.table({"sample_id": rows["sample_id"], "values": [[0.0] * len(x) for x in rows["response_token_ids"]]},
                                  schema=CRITIC_VALUES.arrow), str(root / "values"), schema=CRITIC_VALUES, config_hash="v")
    cfg = CriticConfig(lr=1e-3, micro_batch_size=2, train_batch_size=5, epochs=2, value_clip=None)
    inp = CriticUpdateInput(rollout=r, advantages=a, critic_values=values, model=tiny_model, critic=cfg, out=str(root / "c1"))
    single = run_stage(inp)
    ds = run_stage(CriticUpdateInput(**{**dict(inp), "critic": cfg.model_copy(update={"deepspeed": DeepSpeedConfig(zero_stage=2)}),
                                        "out": str(root / "c2")}), RUNNER)
    assert read_manifest(ds.uri)[0].summary["world_size"] == 2
    want, got = read_shard(single.uri).to_pydict(), read_shard(ds.uri).to_pydict()
    assert len(got["step"]) == 4 and got["num_tokens"] == want["num_tokens"]
    assert got["value_loss"] == pytest.approx(want["value_loss"], abs=1e-6)
    assert want["value_loss"][0] == pytest.approx(0.5)  # V = 0 against returns +-1: 0.5 (V - R)^2 = 0.5 on every token
    w0, w1 = load_critic(f"{single.uri}/critic").state_dict(), load_critic(f"{ds.uri}/critic").state_dict()
    assert max((w1[k] - w0[k]).abs().max().item() for k in w0) < 1e-5
