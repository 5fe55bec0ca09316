"""Device memory and CUDA setup around the stage programs (issue 18): ``release_device_memory``
empties the CUDA cache only where there is one; every in-process stage run enables TF32 first
and hands the cached memory back afterwards; the log-prob program passes ``logprobs.chunk_size``
on; the release happens once, after the program (run_in_process). No GPU here: CUDA calls are recorded."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rft_core.config import LogprobConfig
from rft_core.models.logprobs import release_device_memory
from rft_core.stages import logprobs as logprobs_stage
from rft_core.stages import inprocess, runner
from rft_core.stages.contracts import ActorLogprobsInput
from schemas import read_shard, write_shard
from schemas.columns import ROLLOUT, policy_version_column, single_turn_columns


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA available and initialised; ``empty_cache`` calls counted."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    return calls


def test_release_device_memory_empties_the_cuda_cache_only_when_there_is_one(monkeypatch, fake_cuda):
    assert release_device_memory() is True and fake_cuda == ["empty_cache"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CUDA never used in this process
    assert release_device_memory() is False and fake_cuda == ["empty_cache"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert release_device_memory() is False


@pytest.fixture
def rollout_shard(tiny_model, tmp_path):
    n = 3
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[1, 2], [3, 4, 9], [14]]
    table = pa.table({"sample_id": [f"p{i}#0" for i in range(n)], "prompt_id": [f"p{i}" for i in range(n)],
                      "sample_index": [0] * n, "prompt_token_ids": prompts, "response_token_ids": responses,
                      "response_text": [""] * n, "rollout_logprobs": [[0.0] * len(r) for r in responses],
                      "action_mask": [[True] * len(r) for r in responses], "finish_reason": ["length"] * n,
                      "images": [[] for _ in range(n)], "videos": [[] for _ in range(n)], **single_turn_columns([""] * n), **policy_version_column(n, 0)},
                     schema=ROLLOUT.arrow)
    return write_shard(table, str(tmp_path / "rollout"), schema=ROLLOUT, config_hash="r")


def test_in_process_stage_runs_set_up_cuda_and_release_its_memory(tiny_model, tmp_path, rollout_shard, monkeypatch):
    events = []
    monkeypatch.setattr(inprocess, "configure_cuda_backends", lambda: events.append("configure") or False)
    monkeypatch.setattr(inprocess, "release_models", lambda: events.append("release") or False)
    real = logprobs_stage.batched_response_logprobs
    seen = {}

    def spy(*args, **kwargs):
        seen.update(chunk_size=kwargs.get("chunk_size"))
        events.append("compute")
        return real(*args, **kwargs)

    monkeypatch.setattr(logprobs_stage, "batched_response_logprobs", spy)
    chunked = runner.run_stage(ActorLogprobsInput(rollout=rollout_shard, model=tiny_model, logprobs=LogprobConfig(chunk_size=2),
                                                  temperature=1.0, out=str(tmp_path / "a")))
    assert events == ["configure", "compute", "release"] and seen["chunk_size"] == 2
    whole = runner.run_stage(ActorLogprobsInput(rollout=rollout_shard, model=tiny_model, logprobs=LogprobConfig(),
                                                temperature=1.0, out=str(tmp_path / "b")))
    assert seen["chunk_size"] is None
    a, b = read_shard(chunked).to_pydict(), read_shard(whole).to_pydict()
    for x, y in zip(a["old_logprobs"], b["old_logprobs"]):  # chunks of 2 positions: the same log-probs
        assert x == pytest.approx(y, abs=1e-6)
    # a failing program still releases
    events.clear()
    monkeypatch.setitem(runner.PROGRAMS, "actor_logprobs", lambda inp: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.run_stage(ActorLogprobsInput(rollout=rollout_shard, model=tiny_model, logprobs=LogprobConfig(),
                                            temperature=1.0, out=str(tmp_path / "c")))
    assert events == ["configure", "release"]

