"""Issue 29, fix 4: in bfloat16 the update computes the log-probs the actor and reference passes
compute for the same weights.

Setup, demo-like (configs/grpo_demo.yaml): 8 prompts x 4 samples, prompts of 30-59 tokens,
responses of 10-95, every advantage 0 (iteration 1 with every reward 0), the policy equal to its
reference and to its old policy, k3+ KL loss with coefficient 0.01, lr 2e-6, one optimizer step;
old and reference log-probs from ``batched_response_logprobs`` (the log-prob stages' function,
packed micro-batches of 8 sorted by length), the update on packed micro-batches of 4 in a
shuffled order. The model is the tests' tiny Llama, rounded to bfloat16, with its final norm
weight set to 50 so that its logits have a language model's scale (std 5.6, max 40; the plain
tiny model's logits have std 0.11, which hides every bfloat16 error: there the update saw
approx_kl 1.4e-7 before the fix and 7.7e-9 after it).

The update before the fix (its forward under bfloat16 autocast over float32 weights, which in
iteration 1 are the bfloat16 weights upcast) is reproduced exactly by ``build_strategy`` on the
float32 copy of those weights with ``compute_dtype="bfloat16"``.

Measured on a 2-core CPU (torch 2.13): first step approx_kl / kl_loss before the fix 2.05e-3 /
2.06e-3 (the GPU run of issue 29: 2.1e-3), after it exactly 0 / 0 where both passes put the
samples into the same packed rows (any attention) or attention is eager (this model, this CPU),
and 7.2e-5 / 7.1e-5 with the default sdpa attention on the demo's shapes: torch's CPU
flash-attention kernel picks its query and key block sizes from the packed row's length, so two
log-prob passes of the same weights that group the samples differently disagree by as much, and
the update's value is exactly theirs (asserted; the absolute values depend on the CPU's
kernels and are not). The same holds on
SmolLM2-135M-Instruct (8 samples, sdpa; not run here): 3.8e-3 before the fix, 7.35e-4 after it,
equal to the 7.35e-4 between the two passes; there eager attention does not help (its product
of attention weights and values sums over the packed row's whole key axis, and its rounding
depends on the row's length and the sequence's place in it: 3.6e-3 before, 2.0e-3 after, equal
to the passes' 2.0e-3). Only the same grouping in both passes, or batch-invariant kernels, gives 0.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from rft_core.config import KLConfig
from rft_core.models.loading import load_causal_lm, load_tokenizer
from rft_core.models.logprobs import batched_response_logprobs, build_packed_batch, response_logprobs
from rft_core.training.checkpoint import MASTER_DTYPE_KEY, MASTER_WEIGHTS_KEY, OPTIMIZER_FILE
from rft_core.training.loop import minibatches
from rft_core.training.strategy import OptimizerSettings, build_strategy
from rft_core.training.update import StepMetrics, UpdateData, ppo_update
from tests.update_settings import update_settings
from tests.weights import policy_files

CPU = torch.device("cpu")
OPT = OptimizerSettings(lr=2e-6, betas=(0.9, 0.999), weight_decay=0.0, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def sharp16(tiny_model, tmp_path_factory) -> str:
    """The tiny model rounded to bfloat16 with final norm weight 50 (logits at a language
    model's scale), saved in float32: loaded as bfloat16 or float32 it holds the same values."""
    out = tmp_path_factory.mktemp("sharp16")
    model = load_causal_lm(tiny_model, dtype="bfloat16")
    with torch.no_grad():
        model.model.norm.weight.fill_(50.0)
    model.float().save_pretrained(out)
    load_tokenizer(tiny_model).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def rollout() -> tuple[list[list[int]], list[list[int]]]:
    """32 (prompt, response) token-id pairs of demo-like lengths."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49000, (int(torch.randint(30, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    responses = [torch.randint(3, 49000, (int(torch.randint(10, 96, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(32)]
    return prompts, responses


def _logprobs(path: str, rollout, micro_batch_size: int) -> list[list[float]]:
    """What the actor and reference stages compute: bfloat16 weights, packed micro-batches."""
    prompts, responses = rollout
    return batched_response_logprobs(load_causal_lm(path, dtype="bfloat16"), prompts, responses, pad_token_id=2,
                                     micro_batch_size=micro_batch_size, packing=True)


def _first_step(path: str, rollout, *, logprob_micro: int, update_micro: int, before_fix: bool = False) -> StepMetrics:
    """The first optimizer step of the bfloat16 update (``before_fix``: the pre-fix update's
    forward, autocast over the float32 copy of the same weights) on old = ref log-probs of the
    log-prob pass."""
    prompts, responses = rollout
    old = _logprobs(path, rollout, logprob_micro)
    data = UpdateData(prompts, responses, old, [[0.0] * len(r) for r in responses], ref_logprobs=old)
    if before_fix:
        strategy = build_strategy(load_causal_lm(path, trainable=True), optim=OPT, device=CPU, compute_dtype="bfloat16")
        assert strategy.autocast_dtype == torch.bfloat16 and strategy.master is None
    else:
        strategy = build_strategy(load_causal_lm(path, dtype="bfloat16", trainable=True), optim=OPT, device=CPU)
        assert strategy.master is not None and strategy.autocast_dtype is None
    steps = ppo_update(strategy, data, update_settings(kl=KLConfig(kl_coef=0.01, estimator="k3+"), micro_batch_size=update_micro,
                                                      packing=True, seed=0), pad_token_id=2)
    assert len(steps) == 1 and steps[0].num_tokens == sum(len(r) for r in responses)
    return steps[0]


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_the_update_computes_the_logprob_passes_logprobs_exactly_on_the_same_shapes(sharp16, rollout):
    """One sample per packed row in both passes (the same kernel shapes): the update's first
    step sees the log-prob pass's log-probs bit for bit, so approx_kl, the KL loss and the
    gradient are exactly 0; the pre-fix update saw approx_kl 2.0e-3 there."""
    new = _first_step(sharp16, rollout, logprob_micro=1, update_micro=1)
    assert new.approx_kl == 0.0 and new.kl_loss == 0.0 and new.grad_norm == 0.0
    before = _first_step(sharp16, rollout, logprob_micro=1, update_micro=1, before_fix=True)
    assert before.approx_kl > 1e-3 and before.kl_loss > 1e-3 and before.grad_norm > 1e-3


def _logprobs_grouped_as_the_update(path: str, rollout, micro_batch_size: int, seed: int) -> list[list[float]]:
    """The log-prob pass over the micro-batches the update forms (``minibatches``' seeded
    permutation of one mini-batch, cut into packed rows of ``micro_batch_size`` in that order)."""
    prompts, responses = rollout
    model = load_causal_lm(path, dtype="bfloat16")
    (_, mini), = list(minibatches(len(prompts), epochs=1, batch_size=len(prompts), seed=seed))
    out: list[list[float]] = [[] for _ in prompts]
    with torch.no_grad():
        for s in range(0, len(mini), micro_batch_size):
            idx = mini[s:s + micro_batch_size]
            lp, _ = response_logprobs(model, build_packed_batch([prompts[i] for i in idx], [responses[i] for i in idx]))
            for row, i in enumerate(idx):
                out[i] = lp[row, : len(responses[i])].tolist()
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_on_the_demos_shapes_the_update_adds_no_disagreement_of_its_own(sharp16, rollout, monkeypatch, attention):
    """The demo's shapes: the update's first-step approx_kl is the approx_kl between two
    log-prob passes of the same weights, one grouped as the stage groups the samples (8 per
    packed row, sorted by length), one as the update does (4 per row, shuffled): the update
    itself adds nothing, whatever the attention kernels do with the grouping. On this CPU that
    is 7.2e-5 with sdpa (torch's flash-attention kernel blocks depend on the row's length), a
    28th of the pre-fix 2.0e-3, and exactly 0 with eager attention."""
    monkeypatch.setenv("RFT_ATTN_IMPLEMENTATION", attention)
    new = _first_step(sharp16, rollout, logprob_micro=8, update_micro=4)
    before = _first_step(sharp16, rollout, logprob_micro=8, update_micro=4, before_fix=True)
    stage, as_update = _logprobs(sharp16, rollout, 8), _logprobs_grouped_as_the_update(sharp16, rollout, 4, seed=0)
    diffs = [(x - y) ** 2 for ra, rb in zip(stage, as_update) for x, y in zip(ra, rb)]
    between_passes = 0.5 * sum(diffs) / len(diffs)
    assert new.approx_kl == pytest.approx(between_passes, rel=1e-5, abs=1e-15)
    assert before.approx_kl > 1e-3 and new.approx_kl < before.approx_kl / 10 and new.kl_loss < before.kl_loss / 10


def test_micro_batch_gradients_accumulate_in_float32(sharp16, rollout):
    """Each micro-batch's bfloat16 gradient lands in the float32 master gradient as soon as its
    backward ends (the bfloat16 gradient is then dropped): after two micro-batches the master
    gradient is exactly g1.float() + g2.float(), which differs from a sum in bfloat16."""
    prompts, responses = rollout
    batches = [build_packed_batch(prompts[i:i + 2], responses[i:i + 2]) for i in (0, 2)]

    def loss(model, batch):
        lp, _ = response_logprobs(model, batch)
        return (lp * batch.action_mask).sum() / 100.0

    plain = load_causal_lm(sharp16, dtype="bfloat16", trainable=True)  # no strategy: its own bfloat16 gradients
    grads = []
    for batch in batches:
        plain.zero_grad(set_to_none=True)
        loss(plain, batch).backward()
        grads.append({n: p.grad.clone() for n, p in plain.named_parameters()})
    model = load_causal_lm(sharp16, dtype="bfloat16", trainable=True)
    strategy = build_strategy(model, optim=OPT, device=CPU)
    strategy.zero_grad()
    for batch in batches:
        strategy.backward(loss(model, batch))
        assert all(p.grad is None for p in model.parameters())
    masters = strategy.master.masters
    assert set(masters) == {n for n, _ in model.named_parameters()}  # the tied embedding / LM head: one master
    in_bf16_differs = 0
    for n, m in masters.items():
        g1, g2 = grads[0][n], grads[1][n]
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g1.float() + g2.float()), n
        in_bf16_differs += int(((g1 + g2).float() != m.grad).sum())
    assert in_bf16_differs > 1000  # a bfloat16 sum would have lost these


def _old_format_state(path: str, rollout, out) -> dict:
    """An optimizer.pt as the update before the fix wrote it: AdamW over the parameters while
    they held the float32 masters (here a float32 model), one step taken, plus the masters and
    their rounding dtype; the weights folder holds the masters' bfloat16 rounding."""
    prompts, responses = rollout
    model = load_causal_lm(path, trainable=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.999),
                            weight_decay=0.0)
    lp, _ = response_logprobs(model, build_packed_batch(prompts[:4], responses[:4]))
    lp.sum().backward()
    opt.step()
    state = opt.state_dict()
    state[MASTER_WEIGHTS_KEY] = {n: p.detach().clone() for n, p in model.named_parameters()}
    state[MASTER_DTYPE_KEY] = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    torch.save(state, out / OPTIMIZER_FILE)
    return state


def test_an_optimizer_state_saved_before_the_fix_continues_exactly(sharp16, rollout, tmp_path):
    """The masters and AdamW moments of a pre-fix state load unchanged (same layout: the masters
    take the bfloat16 parameters' places), the parameters stay the checkpoint's bfloat16."""
    saved = _old_format_state(sharp16, rollout, tmp_path)
    model = load_causal_lm(str(tmp_path), dtype="bfloat16", trainable=True)
    strategy = build_strategy(model, optim=OPT, device=CPU, optimizer_state=str(tmp_path))
    names = [n for n, _ in model.named_parameters()]
    for n, m in strategy.master.state().items():
        assert torch.equal(m, saved[MASTER_WEIGHTS_KEY][n])
    assert sum(not torch.equal(m, m.to(torch.bfloat16).float()) for m in strategy.master.state().values()) > 0
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    now = strategy.optimizer.state_dict()
    assert now["param_groups"][0]["lr"] == OPT.lr
    for i, n in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(now["state"][i][key], saved["state"][i][key]), (n, key)
    # what it writes back has the same layout and values
    assert set(now[MASTER_WEIGHTS_KEY]) == set(saved[MASTER_WEIGHTS_KEY]) and now[MASTER_DTYPE_KEY] == "bfloat16"


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_a_resumed_update_continues_the_in_memory_one_bit_for_bit(sharp16, rollout, tmp_path):
    """Iteration 2 from the saved checkpoint and optimizer state ends with the very float32
    masters, moments and bfloat16 weights of iteration 2 run on the trainer kept in memory (the
    resident workers' way)."""
    prompts, responses = rollout
    old = _logprobs(sharp16, rollout, 8)
    g = torch.Generator().manual_seed(5)
    adv = [[float(torch.randn(1, generator=g))] * len(r) for r in responses]
    data = UpdateData(prompts, responses, old, adv, ref_logprobs=old)
    kw = {"kl": KLConfig(kl_coef=0.01), "micro_batch_size": 4, "packing": True, "train_batch_size": 16}
    kept = build_strategy(load_causal_lm(sharp16, dtype="bfloat16", trainable=True), optim=OPT, device=CPU)
    ppo_update(kept, data, update_settings(seed=1, **kw), pad_token_id=2)
    kept.model.save_pretrained(tmp_path)
    torch.save(kept.optimizer.state_dict(), tmp_path / OPTIMIZER_FILE)
    resumed = build_strategy(load_causal_lm(str(tmp_path), dtype="bfloat16", trainable=True), optim=OPT, device=CPU,
                             optimizer_state=str(tmp_path))
    for s in (kept, resumed):
        ppo_update(s, data, update_settings(seed=2, **kw), pad_token_id=2)
    for n, m in kept.master.state().items():
        assert torch.equal(m, resumed.master.state()[n]), n
    a, b = dict(kept.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = kept.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) and float(sa[i]["step"]) == 4.0 for i in sa)


@contextlib.contextmanager
def _spy_on_rows(monkeypatch) -> Iterator[list[dict[str, list[list[int]]]]]:
    """Per update, in order: the micro-batches (sample indices) of the actor and reference passes
    before it (``batched_response_logprobs``' ``groups``, as the log-prob stage hands them) and
    those its first epoch trains on (``_PPOLoss.micro_step``' ``idx``; epochs 1, one mini-batch)."""
    import rft_core.stages.logprobs as stage
    from rft_core.training.update import _PPOLoss

    rows: list[dict[str, list[list[int]]]] = []
    passes = iter(["actor_logprobs", "ref_logprobs"] * 100)
    current: dict[str, list[list[int]]] = {}

    def batched(*args, groups=None, **kwargs):
        if "update" in current:  # the previous update is done: a new iteration's passes
            rows.append(current.copy())
            current.clear()
        current[next(passes)] = [list(g) for g in groups]
        return real_batched(*args, groups=groups, **kwargs)

    def micro_step(self, idx, norm):
        current.setdefault("update", []).append(list(idx))
        return real_step(self, idx, norm)

    real_batched, real_step = stage.batched_response_logprobs, _PPOLoss.micro_step
    monkeypatch.setattr(stage, "batched_response_logprobs", batched)
    monkeypatch.setattr(_PPOLoss, "micro_step", micro_step)
    yield rows
    rows.append(current.copy())
    monkeypatch.undo()


def test_bf16_iterations_start_at_kl_0_and_resident_mode_ends_with_stage_modes_weights(sharp16, tmp_path, monkeypatch):
    """Three bfloat16 iterations of the demo's stages (hf rollout, actor and reference passes,
    update), the log-prob passes grouped as the update groups the samples (``logprob_grouping``,
    whatever ``logprobs.micro_batch_size`` says): iteration 1's update starts at approx_kl 0 and
    KL loss 0 (policy = reference = old policy), iteration 2's at approx_kl 0 too (its actor pass
    scores the new bfloat16 weights as the trainer does) with the KL loss its first step made; a resident trainer that
    keeps its float32 masters and AdamW state in memory (checkpoint every 3) ends with the very
    weights of stage mode, which carries them through optimizer.pt every iteration."""
    from rft_core.config import load_config
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.pool import ROLE_OF_PROGRAM
    from rft_core.workers.reference import ReferenceWorker
    from rft_core.workers.rollout import RolloutWorker
    from schemas import read_manifest, stage_uri
    from tests.drive import drive
    from tests.varying import assert_training_signal, reward_args

    reward = reward_args()  # rewards that vary inside each group (a random model earns no task reward)
    base = ["data.prompts_per_iteration=2", "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12",
            "rollout.batch_size=8", "kl.kl_coef=0.05", "update.lr=1e-3", "iterations=3",
            # different sizes on purpose: below float32 the passes take the update's micro-batches (logprob_grouping)
            "update.micro_batch_size=3", "logprobs.micro_batch_size=8",
            "policy.dtype=bfloat16", f"policy.path={sharp16}", *reward]
    runs = {}
    for mode, extra in (("stage", []), ("resident", ["orchestration.workers=resident", "checkpoint.every=3"])):
        cfg = load_config(None, [*base, *extra, f"run_root={tmp_path / mode}"])
        if mode == "stage":
            with _spy_on_rows(monkeypatch) as rows:
                final = drive(cfg)
            assert_training_signal(cfg.run_root, (1, 2, 3))  # what the two modes must agree on is a real update
            # every iteration's actor and reference passes packed the rows its update's first epoch packs; the
            # update of iteration k shuffles with policy version k - 1 (update_seeds), so the rows change
            assert [r["update"] for r in rows] == [r["actor_logprobs"] for r in rows] == [r["ref_logprobs"] for r in rows]
            assert len(rows) == 3 and len({str(r["update"]) for r in rows}) == 3, rows
        else:
            policy = PolicyWorker("test")
            pool = {"policy": policy, "rollout": RolloutWorker("test", peer=policy),
                    "reference": ReferenceWorker("test")}
            final = drive(cfg, lambda inp: pool[ROLE_OF_PROGRAM[inp.program]].run(inp))
        first, second = (read_manifest(stage_uri(cfg.run_root, it, "ppo_update"))[0].summary for it in (1, 2))
        assert first["optimizer_steps"] == 1 and first["approx_kl"] == 0.0 and first["kl_loss"] == 0.0, (mode, first)
        assert first["grad_norm"] > 0 and second["kl_loss"] > 1e-6, (mode, first, second)  # rewarded, then moved
        # iteration 2's actor pass scored the checkpoint (the masters' rounding) as the trainer computes it
        assert second["approx_kl"] == 0.0, (mode, second)
        runs[mode] = policy_files(final, suffix=".safetensors")
    assert runs["stage"] and runs["stage"] == runs["resident"]


def test_with_a_token_budget_the_passes_take_the_updates_rows_too(sharp16, tmp_path, monkeypatch):
    """``update.max_tokens_per_micro_batch`` below float32: the update cuts each mini-batch by
    tokens (``token_budget_micro_batches``) and the actor and reference passes take those very
    rows (``UpdateGrouping.max_tokens_per_micro_batch``): iteration 1's first step at approx_kl 0
    and KL loss 0, every row within the budget, rows of different sizes (the count cut's would be
    two rows of 4)."""
    from rft_core.config import load_config
    from schemas import read_manifest, read_shard, stage_uri
    from tests.drive import drive
    from rft_core.training.loop import packed_lengths
    from tests.varying import reward_args

    cfg = load_config(None, ["data.prompts_per_iteration=2", "data.size=50", "rollout.n_samples_per_prompt=4",
                             "rollout.max_new_tokens=12", "rollout.batch_size=8", "kl.kl_coef=0.05", "update.lr=1e-3",
                             "iterations=2", "update.max_tokens_per_micro_batch=190", "data.max_prompt_tokens=64",
                             "logprobs.micro_batch_size=8", "policy.dtype=bfloat16", f"policy.path={sharp16}",
                             *reward_args(), f"run_root={tmp_path}"])
    with _spy_on_rows(monkeypatch) as rows:
        drive(cfg)
    assert [r["update"] for r in rows] == [r["actor_logprobs"] for r in rows] == [r["ref_logprobs"] for r in rows]
    for it, r in enumerate(rows, 1):
        table = read_shard(stage_uri(cfg.run_root, it, "rollout"), stage="rollout")
        lengths = packed_lengths(table.column("prompt_token_ids").to_pylist(), table.column("response_token_ids").to_pylist())
        assert all(sum(lengths[i] for i in row) <= 190 for row in r["update"]), (lengths, r)
        assert sorted(len(row) for row in r["update"]) == [2, 3, 3], (lengths, r)  # 8 responses of 59-67 tokens
    first = read_manifest(stage_uri(cfg.run_root, 1, "ppo_update"))[0].summary
    assert first["approx_kl"] == 0.0 and first["kl_loss"] == 0.0 and first["grad_norm"] > 0, first


def test_a_bf16_lora_policy_is_scored_as_the_trainer_computes_it_in_stage_and_resident_mode(sharp16, tmp_path):
    """LoRA on a bfloat16 base: the trainer computes with float32 adapters on top of the bfloat16
    weights; the log-prob passes (and the hf engine) load the adapter checkpoint the same way
    (``load_causal_lm``: unmerged below float32), so every iteration's first update step starts at
    approx_kl 0. Merged into bfloat16 weights the same adapter scores otherwise (an update below
    half a bfloat16 step rounds away): what the passes computed before 2026-12-01 (approx_kl
    6.2e-7 and 1.5e-6 in iterations 2 and 3 of this run). Under resident workers (checkpoint
    every 3) the rollout worker keeps the adapters too: each sync moves the trainer's float32
    adapters only (``WorkersConfig.lora``), onto the bfloat16 base it loaded, and every shard of
    every iteration and the final adapter equal stage mode's bit for bit (with the merged sync of
    before 2026-12-01 the final adapter differed); so do those of a resident run resumed with new
    workers, whose rollout worker loads the stored adapter unmerged and syncs into it."""
    from rft_core.config import load_config
    from rft_core.stages.checkpoints import policy_model_path
    from rft_core.stages.writer import wait_for_optimizer_writes
    from rft_core.weightsync.trained import adapter_tensors
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.pool import ROLE_OF_PROGRAM
    from rft_core.workers.reference import ReferenceWorker
    from rft_core.workers.rollout import RolloutWorker
    from schemas import read_manifest, read_shard, stage_uri
    from tests.drive import drive
    from tests.varying import assert_training_signal, reward_args

    base = ["data.prompts_per_iteration=2", "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12",
            "rollout.batch_size=8", "kl.kl_coef=0.05", "update.lr=1e-3", "iterations=3", "update.micro_batch_size=3",
            "policy.dtype=bfloat16", f"policy.path={sharp16}", "update.lora.rank=8", "update.lora.alpha=16",
            *reward_args()]
    cfg = load_config(None, [*base, f"run_root={tmp_path / 'stage'}"])
    final = drive(cfg)
    assert_training_signal(cfg.run_root, (1, 2, 3))
    summaries = [read_manifest(stage_uri(cfg.run_root, it, "ppo_update"))[0].summary for it in (1, 2, 3)]
    assert all(s["approx_kl"] == 0.0 for s in summaries), summaries
    assert summaries[1]["kl_loss"] > 1e-4 and summaries[2]["kl_loss"] > 1e-4, summaries  # the adapters moved
    adapter = policy_model_path(final)
    rows = read_shard(stage_uri(cfg.run_root, 3, "rollout"), stage="rollout").to_pydict()
    kw = dict(pad_token_id=2, packing=True, micro_batch_size=8)
    kept = batched_response_logprobs(load_causal_lm(adapter, dtype="bfloat16"), rows["prompt_token_ids"],
                                     rows["response_token_ids"], **kw)
    merged = batched_response_logprobs(load_causal_lm(adapter, dtype="bfloat16", merge_adapter=True),
                                       rows["prompt_token_ids"], rows["response_token_ids"], **kw)
    assert max(abs(a - b) for x, y in zip(kept, merged) for a, b in zip(x, y)) > 1e-3

    def pool_of(res):
        workers = res.runner("rollout").workers
        assert workers.lora == res.update.lora
        policy = PolicyWorker("test")
        return {"policy": policy, "rollout": RolloutWorker("test", peer=policy, lora=workers.lora),
                "reference": ReferenceWorker("test")}

    def run(res, pool, **kw):
        return drive(res, lambda inp: pool[ROLE_OF_PROGRAM[inp.program]].run(inp), **kw)

    res = load_config(None, [*base, "orchestration.workers=resident", "checkpoint.every=3",
                             f"run_root={tmp_path / 'resident'}"])
    pool = pool_of(res)
    final_r = run(res, pool)
    adapters = adapter_tensors(pool["policy"].held.strategy.model)
    assert adapters and {t.dtype for t in adapters.values()} == {torch.float32}
    assert [s["bytes"] for s in pool["rollout"].syncs] == [sum(t.numel() * 4 for t in adapters.values())] * 2
    # a resumed resident run (new workers after iteration 1, checkpoint every iteration): the new rollout worker
    # loads iteration 1's adapter checkpoint unmerged, and iteration 2's sync lands in that copy's adapters
    resumed = load_config(None, [*base, "orchestration.workers=resident", f"run_root={tmp_path / 'resumed'}"])
    run(resumed, pool_of(resumed), stop_after=1)
    wait_for_optimizer_writes()
    pool = pool_of(resumed)
    final_resumed = run(resumed, pool)
    assert len(pool["rollout"].syncs) == 1  # version 1 read from storage (unmerged: the shards below), version 2 synced
    for done in (final_r, final_resumed):
        assert policy_files(done, suffix=".safetensors") == policy_files(final, suffix=".safetensors")
    for it in (1, 2, 3):
        for run_cfg in (res, resumed):
            assert read_manifest(stage_uri(run_cfg.run_root, it, "ppo_update"))[0].summary["approx_kl"] == 0.0
            for stage in ("rollout", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update"):
                a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg, run_cfg))
                parts = lambda m: {e.path: e.checksum for e in m.files if e.path.endswith(".parquet")}  # noqa: E731
                assert parts(a) == parts(b), (it, stage, run_cfg.run_root)


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_an_asynchronous_resident_bf16_lora_run_keeps_two_versions_of_the_adapters(sharp16, tmp_path):
    """``rollout.max_staleness=2`` on a bfloat16 LoRA policy: the rollout of iteration k samples
    with version k - 3 while the actor pass scores with version k - 1, so the resident rollout
    worker keeps two copies (``rollout_versions``), each a deep copy that gets the adapters at its
    first sync (``_landing``) and takes adapter syncs after; 4 iterations commit stage mode's
    rollout, actor and update shards bit for bit."""
    from rft_core.config import load_config
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.pool import ROLE_OF_PROGRAM
    from rft_core.workers.reference import ReferenceWorker
    from rft_core.workers.rollout import RolloutWorker
    from schemas import read_manifest, read_shard, stage_uri
    from tests.drive import drive
    from tests.varying import assert_training_signal, reward_args

    base = ["data.prompts_per_iteration=2", "data.size=50", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
            "rollout.batch_size=8", "kl.kl_coef=0.05", "update.lr=1e-3", "iterations=4", "update.micro_batch_size=4",
            "policy.dtype=bfloat16", f"policy.path={sharp16}", "update.lora.rank=4", "update.lora.alpha=8",
            "rollout.max_staleness=2", *reward_args()]
    cfg = load_config(None, [*base, f"run_root={tmp_path / 'stage'}"])
    drive(cfg)
    assert_training_signal(cfg.run_root, (1, 2, 3, 4))
    res = load_config(None, [*base, "orchestration.workers=resident", "checkpoint.every=4",
                             f"run_root={tmp_path / 'resident'}"])
    workers = res.runner("rollout").workers
    assert workers.rollout_versions == 2
    policy = PolicyWorker("test")
    rollout = RolloutWorker("test", peer=policy, lora=workers.lora, rollout_versions=workers.rollout_versions)
    pool = {"policy": policy, "rollout": rollout, "reference": ReferenceWorker("test")}
    drive(res, lambda inp: pool[ROLE_OF_PROGRAM[inp.program]].run(inp))
    versions = [set(read_shard(stage_uri(res.run_root, k, "rollout"), stage="rollout").column("policy_version")
                    .to_pylist()) for k in (1, 2, 3, 4)]
    assert versions == [{0}, {0}, {0}, {1}]
    assert len(rollout.syncs) == 3 and len(rollout._kept) == 1  # versions 1, 2, 3 for the actor passes; two copies
    assert {type(m).__name__ for m in (rollout.model, *rollout._kept.values())} == {"PeftModelForCausalLM"}
    for it in (1, 2, 3, 4):
        for stage in ("rollout", "actor_logprobs", "ppo_update"):
            a, b = (read_manifest(stage_uri(c.run_root, it, stage))[0] for c in (cfg, res))
            parts = lambda m: {e.path: e.checksum for e in m.files if e.path.endswith(".parquet")}  # noqa: E731
            assert parts(a) == parts(b), (it, stage)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py)
def test_passes_grouped_as_the_update_make_its_first_step_exact_on_the_demos_shapes(sharp16, rollout, monkeypatch,
                                                                                     attention):
    """The fix of the remaining 7.2e-5 (sdpa) above: the stages' passes take the update's
    first-epoch micro-batches (``epoch_micro_batches``, what ``TrainConfig.logprob_grouping``
    hands them below float32), so the update's first step computes their log-probs bit for bit:
    approx_kl, KL loss and gradient exactly 0 with every reward 0, as in float32 up to rounding."""
    from rft_core.training.loop import MicroBatching, epoch_micro_batches

    monkeypatch.setenv("RFT_ATTN_IMPLEMENTATION", attention)
    prompts, responses = rollout
    groups = epoch_micro_batches(len(prompts), train_batch_size=None, micro_batching=MicroBatching(4), seed=0)
    assert sorted(i for g in groups for i in g) == list(range(32)) and [len(g) for g in groups] == [4] * 8
    old = batched_response_logprobs(load_causal_lm(sharp16, dtype="bfloat16"), prompts, responses, pad_token_id=2,
                                    micro_batch_size=8, packing=True, groups=groups)
    assert old == _logprobs_grouped_as_the_update(sharp16, rollout, 4, seed=0)
    data = UpdateData(prompts, responses, old, [[0.0] * len(r) for r in responses], ref_logprobs=old)
    strategy = build_strategy(load_causal_lm(sharp16, dtype="bfloat16", trainable=True), optim=OPT, device=CPU)
    step, = ppo_update(strategy, data, update_settings(kl=KLConfig(kl_coef=0.01, estimator="k3+"), micro_batch_size=4,
                                                      packing=True, seed=0), pad_token_id=2)
    assert step.approx_kl == 0.0 and step.kl_loss == 0.0 and step.grad_norm == 0.0
    with pytest.raises(ValueError, match="each of the 32 samples exactly once"):
        batched_response_logprobs(load_causal_lm(sharp16, dtype="bfloat16"), prompts, responses, pad_token_id=2,
                                  groups=groups[1:])


def test_logprob_grouping_is_the_updates_below_float32_only():
    from rft_core.config import UpdateGrouping, load_config
    from rft_core.stages.contracts import ActorLogprobsInput

    assert load_config("configs/grpo_demo.yaml").logprob_grouping is None  # float32: no hash changes
    cfg = load_config("configs/grpo_demo.yaml", ["policy.dtype=bfloat16", "update.seed=3", "update.train_batch_size=16"])
    assert cfg.logprob_grouping == UpdateGrouping(train_batch_size=16, micro_batch_size=4, seed=3, packing=True)
    from schemas import ShardRef

    ref = ShardRef(uri="file:///r", stage="rollout", num_rows=1, config_hash="0" * 16, manifest_sha256="0" * 64)
    base = dict(rollout=ref, model="m", logprobs=cfg.logprobs, temperature=0.7, out="file:///o")
    assert "grouping" not in ActorLogprobsInput(**base).hash_view()
    assert ActorLogprobsInput(**base, grouping=cfg.logprob_grouping).hash_view()["grouping"]["seed"] == 3
    # iteration k's passes take the rows of the update that starts from policy version k - 1 (update_seeds); version 0
    # enters no hash, so iteration 1's committed passes keep their config hash
    assert cfg.logprob_grouping.policy_version == 0
    assert "policy_version" not in ActorLogprobsInput(**base, grouping=cfg.logprob_grouping).hash_view()["grouping"]
    assert ActorLogprobsInput(**base, grouping=cfg.logprob_grouping_at(3)).hash_view()["grouping"]["policy_version"] == 2
    with pytest.raises(ValueError, match="iteration 0 is not >= 1"):
        cfg.logprob_grouping_at(0)
