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

ITERATIONS = 3
ASYNC_LORA = ("rollout.max_staleness=1", "update.lora.rank=8", "update.lora.dropout=0.1",
              "update.gradient_checkpointing=true", "rollout.max_new_tokens=16")


def _weights(run_root) -> dict[str, str]:
    m, _ = read_manifest(stage_uri(str(run_root), ITERATIONS, "ppo_update"))
    return {e.path: e.sha256 for e in m.files if e.path.startswith("policy/")}


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
