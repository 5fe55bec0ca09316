"""The prefetched rollout's randomness is its own (issue 39): with ``rollout.max_staleness: 1``
in stage mode the rollout of iteration k+1 runs in a thread of the process that trains iteration
k. The HF engine draws from its own ``torch.Generator`` (``rft_core.engines.hf``) and the update
seeds its own draws (``rft_core.training.update.update_rng``), so LoRA dropout and gradient
checkpointing (which saves and restores torch's global RNG state) in the update cannot change
the rollout's tokens, nor the rollout the update's dropout masks: two runs end with the same
weights bit for bit. Each update draws its own masks (issue 46: ``update.seed`` mixed with the
policy version, ``rft_core.training.update.update_seeds``), the same in two runs."""
from __future__ import annotations

import datetime as dt

import pytest
import torch

from schemas import read_manifest, stage_uri
from tests.varying import assert_advantages_vary, assert_weights_moved, varying_config
from tests.weights import iteration_policy_files

ITERATIONS = 3
ASYNC_LORA = ("rollout.max_staleness=1", "update.lora.rank=8", "update.lora.dropout=0.1",
              "update.gradient_checkpointing=true", "rollout.max_new_tokens=16")


def _weights(run_root) -> dict[str, str]:
    return iteration_policy_files(run_root, ITERATIONS)


def _window(uri: str) -> tuple[float, float]:
    m, _ = read_manifest(uri)
    end = dt.datetime.fromisoformat(m.created_at).timestamp()
    return end - float(m.summary["seconds"]) - float(m.summary.get("checkpoint_seconds", 0.0)), end


@pytest.fixture
def dropout_calls(monkeypatch) -> list[float]:
    """The rate of every ``nn.Dropout`` call that dropped something (train mode, p > 0): with
    ``dropout_disabled`` on every other dropout of the model, these are peft's ``lora_dropout``."""
    calls: list[float] = []
    forward = torch.nn.Dropout.forward

    def counting(self, x):
        if self.training and self.p > 0:
            calls.append(self.p)
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Dropout, "forward", counting)
    return calls


def test_the_hf_engine_neither_reads_nor_moves_the_global_generator(tiny_model):
    from rft_core.engines.hf import HFEngine
    from rft_core.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model)
    engine = HFEngine(load_causal_lm(tiny_model).eval(), tok)
    prompts = [tok.encode(t) for t in ("one two", "three four five", "six")]
    runs, states = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        gens = engine.generate(prompts, n_samples_per_prompt=2, max_new_tokens=8, batch_size=2, seed=7, top_p=0.9)
        states.append(torch.equal(torch.get_rng_state(), before))
        runs.append([(g.response_token_ids, g.logprobs) for g in gens])
    assert states == [True, True] and runs[0] == runs[1]
    assert len({tuple(t) for t, _ in runs[0]}) > 1  # sampled, not one response repeated


def test_the_update_seeds_its_own_dropout_and_restores_the_global_generator(tiny_model, dropout_calls):
    from rft_core.models.loading import load_causal_lm
    from rft_core.models.lora import apply_lora
    from rft_core.training.strategy import SingleProcess
    from rft_core.training.update import UpdateData, ppo_update
    from tests.update_settings import update_settings

    prompts, responses = [[11, 12, 13], [21, 22]], [[101, 102, 103], [201, 202, 203, 204]]
    data = UpdateData(prompts, responses, [[-2.0] * len(r) for r in responses], [[1.0] * 3, [-1.0] * 4])

    def update(global_seed: int, seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        model = apply_lora(load_causal_lm(tiny_model, trainable=True), rank=4, alpha=8.0, dropout=0.5,
                           target_modules="all-linear", base_path=tiny_model, seed=0)  # the same A matrices
        before = torch.get_rng_state()
        ppo_update(SingleProcess(model, torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=1.0),
                                 max_grad_norm=1e9), data, update_settings(seed=seed), pad_token_id=2)
        assert torch.equal(torch.get_rng_state(), before)  # the process's generator as it was
        return torch.cat([q.detach().flatten() for n, q in model.named_parameters() if "lora_" in n])

    first = update(0, seed=0)
    assert dropout_calls and set(dropout_calls) == {0.5}  # LoRA dropout drew masks
    assert torch.equal(update(1, seed=0), first)  # whatever the global generator held before
    assert (update(0, seed=1) - first).abs().max() > 1e-6  # the update's seed sets the masks (rounding: ~1e-12)


@pytest.mark.rotation(1)  # long: one turn in 8 (tests/rotation.py)
def test_two_staleness_1_runs_with_lora_dropout_and_checkpointing_end_equal(prefect_harness, tiny_model, tmp_path,
                                                                             dropout_calls):
    from flows.train import train

    roots = [tmp_path / "a", tmp_path / "b"]
    train(varying_config(tiny_model, roots[0], *ASYNC_LORA, iterations=ITERATIONS))
    # what the equality below is about: LoRA dropout drew masks in the updates, the advantages are not
    # zero, the weights moved, and the prefetched rollouts overlapped the updates
    assert dropout_calls and set(dropout_calls) == {0.1}
    for k in range(1, ITERATIONS + 1):
        assert_advantages_vary(roots[0], k)
    assert_weights_moved(roots[0], ITERATIONS, tiny_model)
    for k in (1, 2):
        ahead, update = _window(stage_uri(str(roots[0]), k + 1, "rollout")), _window(stage_uri(str(roots[0]), k, "ppo_update"))
        assert ahead[0] < update[1], (k, ahead, update)
    train(varying_config(tiny_model, roots[1], *ASYNC_LORA, iterations=ITERATIONS))
    for k in range(1, ITERATIONS + 1):  # every rollout the same tokens, then the same weights
        rollouts = [{e.path: e.checksum for e in read_manifest(stage_uri(str(r), k, "rollout"))[0].files} for r in roots]
        assert rollouts[0] == rollouts[1], k
    assert _weights(roots[0]) == _weights(roots[1]) and _weights(roots[0])


# s = 0, LoRA dropout 0.5 (half of each adapter input zeroed); the policy and the rollout engine kept in this
# process's resident workers (no Ray, no reloads) so that two runs of 3 iterations take seconds
S0_LORA = ("update.lora.rank=8", "update.lora.dropout=0.5", "kl.kl_coef=0", "update.epochs=1", "update.micro_batch_size=8",
           "data.prompts_per_iteration=2", "rollout.batch_size=8", "rollout.max_new_tokens=4",
           "orchestration.workers=resident", "checkpoint.every=3")


def _drive_recording_masks(cfg, monkeypatch) -> tuple[dict[int, list[torch.Tensor]], dict[int, torch.Tensor]]:
    """Run ``cfg`` without Prefect (``tests.drive``) with its model stages in resident workers of
    this process, and return, per iteration, the dropout masks its update drew (bool, flattened,
    in call order: True where ``nn.Dropout`` zeroed an element) and the global generator's state
    at its first draw."""
    from rft_core.stages import update as update_stage
    from rft_core.workers.policy import PolicyWorker
    from rft_core.workers.pool import ROLE_OF_PROGRAM
    from rft_core.workers.rollout import RolloutWorker
    from tests.drive import drive

    masks: dict[int, list[torch.Tensor]] = {}
    first_state: dict[int, torch.Tensor] = {}
    current: dict[str, int] = {}
    real_update, forward = update_stage.ppo_update, torch.nn.Dropout.forward

    def recording_update(strategy, data, settings, **kw):
        current["iteration"] = settings.policy_version + 1  # the update of iteration k starts from version k - 1
        try:
            return real_update(strategy, data, settings, **kw)
        finally:
            del current["iteration"]

    def recording_forward(self, x):
        if not (self.training and self.p > 0 and "iteration" in current):
            return forward(self, x)
        k = current["iteration"]
        first_state.setdefault(k, torch.get_rng_state())
        out = forward(self, x)
        masks.setdefault(k, []).append(((out == 0) & (x != 0)).flatten())
        return out

    policy = PolicyWorker(cfg.run_root)
    pool = {"policy": policy, "rollout": RolloutWorker(cfg.run_root, peer=policy)}
    with monkeypatch.context() as m:
        m.setattr(update_stage, "ppo_update", recording_update)
        m.setattr(torch.nn.Dropout, "forward", recording_forward)
        drive(cfg, lambda inp: pool[ROLE_OF_PROGRAM[inp.program]].run(inp))
    return masks, first_state


def test_two_s0_runs_with_lora_dropout_are_equal_and_each_iteration_draws_its_own_masks(tiny_model, tmp_path,
                                                                                          monkeypatch):
    roots = [tmp_path / "a", tmp_path / "b"]
    runs = [_drive_recording_masks(varying_config(tiny_model, r, *S0_LORA, iterations=ITERATIONS), monkeypatch)
            for r in roots]
    (masks, state), (masks_b, state_b) = runs
    # what the comparisons are about: the updates trained on varying advantages and drew LoRA dropout masks
    for k in range(1, ITERATIONS + 1):
        assert_advantages_vary(roots[0], k)
    assert_weights_moved(roots[0], ITERATIONS, tiny_model)
    assert sorted(masks) == [1, 2, 3] and all(any(m.any() for m in masks[k]) for k in masks)
    # two runs: the same masks in every iteration, the same weights
    for k in masks:
        assert len(masks[k]) == len(masks_b[k]) and all(torch.equal(x, y) for x, y in zip(masks[k], masks_b[k])), k
    assert _weights(roots[0]) == _weights(roots[1]) and _weights(roots[0])
    # within a run, each iteration its own stream: iterations 2 and 3 start from other generator states and their
    # first masks differ on the elements both have (one stream would give the same leading draws)
    assert not torch.equal(state[2], state[3]) and not torch.equal(state[1], state[2])
    first2, first3 = masks[2][0], masks[3][0]
    n = min(len(first2), len(first3))
    assert n > 100 and (first2[:n] != first3[:n]).float().mean() > 0.2
