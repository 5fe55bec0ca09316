"""The prefetched rollout's randomness is its own (issue 39): with ``rollout.max_staleness: 1``
in stage mode the rollout of iteration k+1 runs in a thread of the process that trains iteration
k. The HF engine draws from its own ``torch.Generator`` (``rft_core.engines.hf``) and the update
seeds its own draws (``rft_core.training.update.update_rng``), so LoRA dropout and gradient
checkpointing (which saves and restores torch's global RNG state) in the update cannot change
the rollout's tokens, nor the rollout the update's dropout masks: two runs end with the same
weights bit for bit."""
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
        rollouts = [{e.path: e.sha256 for e in read_manifest(stage_uri(str(r), k, "rollout"))[0].files} for r in roots]
        assert rollouts[0] == rollouts[1], k
    assert _weights(roots[0]) == _weights(roots[1]) and _weights(roots[0])
