"""Mixed precision that learns (issue 18): a bfloat16 policy or critic trains float32 master
weights (AdamW state in float32) with forward and backward on its bfloat16 parameters (issue 29:
the weights the log-prob passes use) and float32 gradients; the checkpoint is bfloat16 and the
float32 masters travel in the optimizer state to the next update.

Reference: the same update in float32 from the same (bfloat16-representable) start weights. With
lr 1e-6 one AdamW step moves every weight by about lr * sign(g), far below bfloat16's resolution
(half an ulp of a weight w is between |w| * 2**-9 and |w| * 2**-8: 6.1e-5 at |w| = 0.02; a 1e-6 step
is lost on every weight of magnitude >= 2**-11 = 4.9e-4), so bfloat16 parameters under plain
AdamW keep almost all of their values (the old path), while the master weights move like the
float32 reference: the update vectors agree to cosine >= 0.99 and a relative L2 error <= 0.1
(measured on this tiny model: 0.9995 and 0.032 under issue 18's autocast over the masters, 0.99988
and 0.018 with forward and backward on the bfloat16 parameters), no weight off by more than 2 lr
per step (a sign flip of a gradient that is near zero).
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors import safe_open

from rft_core.config import CriticConfig, KLConfig, UpdateConfig
from rft_core.models.critic import load_critic
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs, build_packed_batch, response_logprobs
from rft_core.stages.contracts import PPOUpdateInput
from rft_core.stages.runner import run_stage
from rft_core.training.checkpoint import MASTER_DTYPE_KEY, MASTER_WEIGHTS_KEY, OPTIMIZER_FILE
from rft_core.training.critic import CriticData, critic_update
from rft_core.training.strategy import OptimizerSettings, SingleProcess, build_strategy
from rft_core.training.update import UpdateData, ppo_update
from schemas import ShardRef, write_shard
from schemas.columns import ADVANTAGES, ROLLOUT, policy_version_column, single_turn_columns
from tests.update_settings import update_settings

LR = 1e-6
OPT = OptimizerSettings(lr=LR, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny16(tiny_model, tmp_path_factory) -> str:
    """The tiny model with every weight rounded to bfloat16, saved in float32: the bfloat16 and
    the float32 runs start from identical weights."""
    out = tmp_path_factory.mktemp("tiny16")
    load_causal_lm(tiny_model, dtype="bfloat16").float().save_pretrained(out)
    load_tokenizer(tiny_model).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def data(tiny16) -> UpdateData:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 2, 4, 6, 3)]
    responses = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 2, 5, 3, 6, 2)]
    old = batched_response_logprobs(load_causal_lm(tiny16), prompts, responses, pad_token_id=2)
    adv = [[a] * len(r) for a, r in zip([1.0, -1.0, 0.5, -0.5, 1.0, -1.0], responses)]
    return UpdateData(prompts, responses, old, adv)


def _flat(tensors: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([tensors[n].detach().float().flatten() for n in names])


def _assert_update_matches(got: torch.Tensor, want: torch.Tensor, steps: int, *, max_rel: float = 0.1) -> None:
    """The stated tolerance: cosine >= 0.99, relative L2 <= ``max_rel``, max |diff| <= 2 lr per step."""
    assert want.abs().max() > 0.5 * LR  # the reference did move
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    rel = ((got - want).norm() / want.norm()).item()
    assert cos >= 0.99 and rel <= max_rel, (cos, rel)
    assert (got - want).abs().max().item() <= 2 * LR * steps + 1e-9


def _reference_update(path: str, data: UpdateData, **kw) -> dict[str, torch.Tensor]:
    """The float32 update (plain AdamW, float32 weights) of ``path``."""
    model = load_causal_lm(path, trainable=True)
    strategy = build_strategy(model, optim=OPT, device=CPU)
    assert strategy.master is None
    ppo_update(strategy, data, update_settings(micro_batch_size=3, **kw), pad_token_id=2)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_bf16_update_with_lr_1e6_moves_the_master_weights_like_float32(tiny16, data):
    init = dict(load_causal_lm(tiny16).named_parameters())
    names = list(init)
    ref = _reference_update(tiny16, data)
    model = load_causal_lm(tiny16, dtype="bfloat16", trainable=True)
    strategy = build_strategy(model, optim=OPT, device=CPU)
    # the parameters stay bfloat16 (what the log-prob passes run), the forward runs without autocast
    assert strategy.master is not None and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with strategy.autocast():
        assert not torch.is_autocast_enabled("cpu")
    ppo_update(strategy, data, update_settings(micro_batch_size=3), pad_token_id=2)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # after training: the checkpoint dtype
    assert all(p.grad is None for p in model.parameters())  # the bfloat16 gradients went into the masters'
    master = strategy.master.state()
    assert {t.dtype for t in master.values()} == {torch.float32}
    moved = _flat(master, names) - _flat(init, names)
    assert (moved != 0).float().mean() > 0.99  # every weight the gradient reaches moved
    _assert_update_matches(moved, _flat(ref, names) - _flat(init, names), steps=1)
    # the AdamW state is float32 and belongs to the master weights
    moments = [s["exp_avg_sq"] for s in strategy.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    # the bfloat16 weights are the round-to-nearest rounding of the masters
    for n, p in model.named_parameters():
        assert torch.equal(p.data, master[n].to(torch.bfloat16))


def test_the_old_path_bf16_params_with_plain_adamw_does_not_move_them(tiny16, data):
    """What happened before: AdamW directly on the bfloat16 parameters. The 1e-6 steps round
    away on all weights but those of magnitude below 2**-11 = 4.9e-4 (about 2% of N(0, 0.02))."""
    init = dict(load_causal_lm(tiny16).named_parameters())
    model = load_causal_lm(tiny16, dtype="bfloat16", trainable=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ppo_update(SingleProcess(model, opt, max_grad_norm=1.0), data, update_settings(micro_batch_size=3), pad_token_id=2)
    names = list(init)
    moved = _flat(dict(model.named_parameters()), names) - _flat(init, names)
    assert (moved != 0).float().mean() < 0.05
    ref = _reference_update(tiny16, data)
    want = _flat(ref, names) - _flat(init, names)
    assert torch.nn.functional.cosine_similarity(moved, want, dim=0).item() < 0.5  # not the float32 update


def test_master_weights_travel_in_the_optimizer_state_to_the_next_update(tiny16, data, tmp_path):
    """Iteration 1 saves the bfloat16 checkpoint and the optimizer state; iteration 2 loads both
    and continues from the exact float32 masters: after 2 iterations it matches 2 float32 steps
    (the float32 reference carries its AdamW state the same way)."""
    tok = load_tokenizer(tiny16)
    init = dict(load_causal_lm(tiny16).named_parameters())
    names = list(init)
    ref_model = load_causal_lm(tiny16, trainable=True)
    ref = build_strategy(ref_model, optim=OPT, device=CPU)
    model = load_causal_lm(tiny16, dtype="bfloat16", trainable=True)
    s1 = build_strategy(model, optim=OPT, device=CPU)
    for strategy in (ref, s1):
        ppo_update(strategy, data, update_settings(micro_batch_size=3, seed=1), pad_token_id=2)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    state = s1.optimizer.state_dict()
    assert state[MASTER_DTYPE_KEY] == "bfloat16" and set(state[MASTER_WEIGHTS_KEY]) == set(names)
    torch.save(state, tmp_path / "ckpt" / OPTIMIZER_FILE)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"

    again = load_causal_lm(str(tmp_path / "ckpt"), dtype="bfloat16", trainable=True)
    s2 = build_strategy(again, optim=OPT, device=CPU, optimizer_state=str(tmp_path / "ckpt"))
    for n, m in s2.master.state().items():  # the exact masters, not the bfloat16 weights upcast
        assert torch.equal(m, state[MASTER_WEIGHTS_KEY][n])
    assert sum(not torch.equal(m, m.to(torch.bfloat16).float()) for m in s2.master.state().values()) > 0
    assert float(next(iter(s2.optimizer.state.values()))["step"]) == 1.0
    for strategy in (ref, s2):
        ppo_update(strategy, data, update_settings(micro_batch_size=3, seed=2), pad_token_id=2)
    got = _flat(s2.master.state(), names) - _flat(init, names)
    want = _flat(dict(ref_model.named_parameters()), names) - _flat(init, names)
    _assert_update_matches(got, want, steps=2)

    # a float32 update continuing the bfloat16 run starts from the masters too
    f32 = load_causal_lm(str(tmp_path / "ckpt"), trainable=True)
    build_strategy(f32, optim=OPT, device=CPU, optimizer_state=str(tmp_path / "ckpt"))
    assert all(torch.equal(p.data, state[MASTER_WEIGHTS_KEY][n]) for n, p in f32.named_parameters())
    # the optimizer state of another checkpoint is refused, naming the file and a weight
    other = load_causal_lm(tiny16, dtype="bfloat16", trainable=True)
    with pytest.raises(ValueError, match=r"optimizer.pt: master weight '.*' does not round to the loaded"):
        build_strategy(other, optim=OPT, device=CPU, optimizer_state=str(tmp_path / "ckpt"))


def test_float16_training_and_a_mismatched_compute_dtype_are_refused(tiny16):
    model = load_causal_lm(tiny16, trainable=True).to(torch.float16)
    with pytest.raises(ValueError, match="float16 needs loss scaling"):
        build_strategy(model, optim=OPT, device=CPU)
    bf16 = load_causal_lm(tiny16, dtype="bfloat16", trainable=True)
    with pytest.raises(ValueError, match="parameters are torch.bfloat16 but the compute dtype is torch.float32"):
        build_strategy(bf16, optim=OPT, device=CPU, compute_dtype="float32")


def test_lora_on_a_bf16_base_computes_in_its_own_dtypes_and_keeps_its_float32_adapters(tiny16, data):
    """peft keeps the adapters in float32: they are their own masters, the frozen base stays
    bfloat16, the forward runs in those dtypes (no autocast; at B = 0 it gives exactly the
    bfloat16 base's log-probs, what the log-prob passes compute from the merged model), and the
    optimizer state needs no master weights."""
    from rft_core.models.lora import apply_lora

    model = apply_lora(load_causal_lm(tiny16, dtype="bfloat16", trainable=True), rank=2, alpha=4.0, dropout=0.0,
                       target_modules="all-linear", base_path=tiny16)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert before and {p.dtype for p in before.values()} == {torch.float32}
    strategy = build_strategy(model, optim=OPT, device=CPU)
    assert strategy.master is None and strategy.autocast_dtype is None
    batch = build_packed_batch(data.prompts, data.responses)  # B = 0: exactly the bfloat16 base's log-probs
    with torch.no_grad(), strategy.autocast():
        lp, _ = response_logprobs(model, batch)
        assert torch.equal(lp, response_logprobs(load_causal_lm(tiny16, dtype="bfloat16"), batch)[0])
    ppo_update(strategy, data, update_settings(micro_batch_size=3), pad_token_id=2)
    after = dict(model.named_parameters())
    moved = torch.cat([(after[n].detach() - before[n]).flatten() for n in before])
    assert (moved != 0).float().mean() > 0.4  # lora_B moves (lora_A has no gradient while B = 0)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert MASTER_WEIGHTS_KEY not in strategy.optimizer.state_dict()


def test_bf16_critic_trains_float32_masters(tiny16, tmp_path):
    """A critic with a random (bfloat16-representable) value head, so that the backbone gets
    gradients too: bfloat16 with masters matches float32; without masters it barely moves."""
    critic = load_critic(tiny16)
    with torch.no_grad():
        critic.score.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
        critic.score.weight.copy_(critic.score.weight.to(torch.bfloat16).float())
    critic.save_pretrained(tmp_path / "critic")
    path = str(tmp_path / "critic")
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[1, 2], [3, 4, 9], [14]]
    data = CriticData(prompts, responses, [[0.0] * len(r) for r in responses], [[1.0] * len(r) for r in responses])
    runs = {}
    for dtype in ("float32", "bfloat16", "plain-bfloat16"):
        critic = load_critic(path, dtype=dtype.removeprefix("plain-"), trainable=True)
        if dtype == "plain-bfloat16":
            strategy = SingleProcess(critic, torch.optim.AdamW(critic.parameters(), lr=LR), max_grad_norm=1.0)
        else:
            strategy = build_strategy(critic, optim=OPT, device=CPU, compute_dtype=dtype)
        critic_update(strategy, data, CriticConfig(value_clip=None, micro_batch_size=2), pad_token_id=2)
        runs[dtype] = strategy.master.state() if strategy.master else dict(critic.named_parameters())
    init = dict(load_critic(path).named_parameters())
    names = list(init)
    want = _flat(runs["float32"], names) - _flat(init, names)
    # the critic's gradients are the noisiest in bfloat16 (a bfloat16 value head, many near-zero
    # gradients whose sign AdamW's first step takes): measured cosine 0.9945 and relative L2 0.104
    # with forward and backward in bfloat16 (0.9963 and 0.086 under issue 18's autocast)
    _assert_update_matches(_flat(runs["bfloat16"], names) - _flat(init, names), want, steps=1, max_rel=0.15)
    assert ((_flat(runs["plain-bfloat16"], names) - _flat(init, names)) != 0).float().mean() < 0.05


def _shards(root: Path, tiny16: str) -> tuple[ShardRef, ShardRef]:
    """A rollout of 6 samples (old log-probs from the model) and +-1 advantages."""
    g = torch.Generator().manual_seed(3)
    n = 6
    prompts = [torch.randint(3, 500, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 500, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    old = batched_response_logprobs(load_causal_lm(tiny16), prompts, responses, pad_token_id=2)
    ids = [f"p{i // 2}#{i % 2}" for i in range(n)]
    pids = [s.split("#")[0] for s in ids]
    rollout = pa.table({"sample_id": ids, "prompt_id": pids, "sample_index": [i % 2 for i in range(n)],
                        "prompt_token_ids": prompts, "response_token_ids": responses, "response_text": [""] * n,
                        "rollout_logprobs": old, "action_mask": [[True] * len(r) for r in responses],
                        "finish_reason": ["length"] * n, "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)],
                        **single_turn_columns([""] * n), **policy_version_column(n, 0)},
                       schema=ROLLOUT.arrow)
    adv = [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(responses)]
    advantages = pa.table({"sample_id": ids, "prompt_id": pids, "shaped_rewards": [0.0] * n,
                           "kl": [[0.0] * len(r) for r in responses], "advantages": adv, "returns": adv},
                          schema=ADVANTAGES.arrow)
    return (write_shard(rollout, str(root / "rollout"), schema=ROLLOUT, config_hash="r"),
            write_shard(advantages, str(root / "advantages"), schema=ADVANTAGES, config_hash="a"))


def test_ppo_update_stage_in_bf16_commits_bf16_weights_and_learns_across_iterations(tiny16, tmp_path):
    """Through the stage program: two iterations in bfloat16 and in float32 from the same start.
    The bfloat16 checkpoints are bfloat16 (what the next rollout loads); the optimizer stage holds
    the float32 masters, whose rounding the checkpoint is; after two iterations the masters moved
    like the float32 weights."""
    r, a = _shards(tmp_path, tiny16)
    cfg = UpdateConfig(lr=LR, micro_batch_size=2)
    refs = {}
    for dtype in ("float32", "bfloat16"):
        policy: str | ShardRef = tiny16
        for it in (1, 2):
            policy = run_stage(PPOUpdateInput(rollout=r, advantages=a, policy=policy, update=cfg, kl=KLConfig(),
                                              temperature=1.0, dtype=dtype, out=str(tmp_path / f"{dtype}-{it}")))
        refs[dtype] = policy
    ckpt = Path(refs["bfloat16"].uri) / "policy"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    state = torch.load(Path(refs["bfloat16"].uri + "-optimizer") / OPTIMIZER_FILE, weights_only=True)
    master = state[MASTER_WEIGHTS_KEY]
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert torch.equal(master["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16),
                       saved["model.layers.0.mlp.up_proj.weight"])
    init = dict(load_causal_lm(tiny16).named_parameters())
    names = list(init)
    want = _flat(dict(load_causal_lm(f"{refs['float32'].uri}/policy").named_parameters()), names) - _flat(init, names)
    _assert_update_matches(_flat(master, names) - _flat(init, names), want, steps=2)
    # the bfloat16 checkpoint alone, without the masters, would have kept almost every weight
    rounded = _flat(dict(load_causal_lm(str(ckpt)).named_parameters()), names) - _flat(init, names)
    assert (rounded != 0).float().mean() < 0.1
