"""A rank of an FSDP2 job that receives its shards from rank 0 loads the model inside
``meta_shell`` (``rft_core.training.fsdp.weights_on_rank0``): it resolves a committed checkpoint
without its weight files. Locally it does not hash them (a damaged weight file is rank 0's to
find; its config and tokenizer are still checked); from remote storage it downloads the folder
without them, into a cache folder of its own, so that a full load on the same machine (rank 0)
still downloads the weights."""
from __future__ import annotations

import os

import fsspec
import pytest

from rft_core.models.pretrained import meta_shell
from rft_core.stages.checkpoints import policy_model_path
from schemas import ShardCorruptError, ShardRef
from tests.rft_core.stages.test_retention import _checkpoint_stage


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_shell_load_does_not_hash_the_weights_but_checks_the_rest(tmp_path):
    ref = _checkpoint_stage(str(tmp_path / "run"), 1)
    _flip(tmp_path / "run/iter=000001/ppo_update/policy/model.safetensors")  # same size, another checksum
    with pytest.raises(ShardCorruptError, match="model.safetensors"):
        policy_model_path(ref)
    with meta_shell():
        assert policy_model_path(ref) == f"{ref.uri}/policy"  # the weights are rank 0's to read and check
    _flip(tmp_path / "run/iter=000001/ppo_update/policy/tokenizer.json")
    with meta_shell(), pytest.raises(ShardCorruptError, match="tokenizer.json"):
        policy_model_path(ref)


def test_a_shell_load_downloads_a_remote_checkpoint_without_its_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("RFT_CACHE_DIR", str(tmp_path / "cache"))
    local = _checkpoint_stage(str(tmp_path / "run"), 1)
    remote = f"memory://shell-{tmp_path.name}/iter=000001/ppo_update"
    fs = fsspec.filesystem("memory")
    fs.put(local.uri + "/", remote.removeprefix("memory://") + "/", recursive=True)
    ref = ShardRef(**{**local.model_dump(), "uri": remote})
    with meta_shell():
        shell = policy_model_path(ref)
    assert sorted(os.listdir(shell)) == ["config.json", "tokenizer.json"]  # no weights, no AdamW state
    full = policy_model_path(ref)
    assert full != shell and "model.safetensors" in os.listdir(full)  # rank 0 on the same machine still gets them
