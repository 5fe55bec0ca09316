"""Issue 38: a run folder refused because a stage contract changed says which stage (name,
iteration, the old and the new contract id) and how to go on: the version that wrote it, a new
run folder, or a new run from the run's last policy checkpoint, given as the command with that
checkpoint's real path, which `policy.path` loads."""
from __future__ import annotations

import re
import shutil
from typing import ClassVar

import pyarrow as pa
import pytest

from rft_core.stages.common import stage_commit
from rft_core.stages.contracts import StageInput
from schemas import OlderVersionError, ShardRef, commit_files, stage_uri, write_shard
from schemas.columns import PROMPTS

REF = ShardRef(uri="memory://x/p", stage="prompts", num_rows=1, config_hash="h", manifest_sha256="a" * 64)
ROW = {"prompt_id": "p-0", "data_source": "t", "question": "q", "prompt_text": "q", "prompt_token_ids": [1],
       "answer": "1", "metadata_json": "{}", "images": [], "videos": []}


class _Demo(StageInput):  # contract "demo v1"
    program: ClassVar[str] = "demo"
    stage: ClassVar[str] = "demo"
    prompts: ShardRef


def _refused(uri: str, contract: str | None) -> str:
    write_shard(pa.Table.from_pylist([ROW], schema=PROMPTS.arrow), uri, schema=PROMPTS, config_hash="0123456789abcdef",
                contract=contract)
    with pytest.raises(OlderVersionError) as info:
        stage_commit(_Demo(prompts=REF, out=uri), stage="prompts").committed()
    return str(info.value)


def test_the_refusal_names_the_stage_and_the_command_from_the_last_checkpoint(tmp_path, tiny_model):
    import torch

    from rft_core.config import load_config
    from rft_core.models.loading import load_causal_lm

    root = str(tmp_path / "run")
    for it in (1, 2):  # committed policy checkpoints (HF folders)
        shutil.copytree(tiny_model, f"{stage_uri(root, it, 'ppo_update')}/policy")
        commit_files(stage_uri(root, it, "ppo_update"), stage="ppo_update", config_hash=f"u{it}", contract="ppo_update v1")
    (tmp_path / "metrics").mkdir()  # iteration 3: an update that wrote no weights (checkpoint.every > 1)
    shutil.copy(f"{tiny_model}/config.json", tmp_path / "metrics" / "steps.json")
    shutil.copytree(tmp_path / "metrics", stage_uri(root, 3, "ppo_update"))
    commit_files(stage_uri(root, 3, "ppo_update"), stage="ppo_update", config_hash="u3", contract="ppo_update v1")

    text = _refused(stage_uri(root, 4, "prompts"), "demo v0")
    assert text.startswith(f"{stage_uri(root, 4, 'prompts')}: stage 'prompts' of iteration 4 was written by an older "
                           "version of prefect-rft (stage contract demo v0; this version writes demo v1)")
    assert "start a new run folder (--run-root <new folder>, or no --run-root for a new timestamped one)" in text
    checkpoint = f"{root}/iter=000002/ppo_update/policy"  # the last one with weights, not iteration 3
    assert f"last checkpoint (iteration 2): rft train -c <your config> --set policy.path={checkpoint} " in text
    assert "--set reference.path=<the policy.path this run started from>" in text
    # the command's checkpoint is the model it names: policy.path loads it, reference.path keeps the first one
    given = re.search(r"--set policy\.path=(\S+)", text).group(1)
    cfg = load_config(None, {"policy.path": given, "reference.path": tiny_model})
    assert (cfg.policy.path, cfg.reference_model.path) == (checkpoint, tiny_model)
    loaded, original = load_causal_lm(cfg.policy.path), load_causal_lm(tiny_model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values()))

    # no contract at all (before contracts existed), and a newer one: named as such
    assert "written by an older version of prefect-rft (stage contract none; this version writes demo v1)" in _refused(
        stage_uri(root, 5, "prompts"), None)
    assert "written by a newer version of prefect-rft (stage contract demo v2; this version writes demo v1)" in _refused(
        stage_uri(root, 6, "prompts"), "demo v2")


def test_without_a_checkpoint_or_a_run_the_refusal_says_so(tmp_path):
    text = _refused(stage_uri(str(tmp_path / "run"), 1, "prompts"), "demo v0")
    assert "stage 'prompts' of iteration 1" in text and "policy.path" not in text
    assert text.endswith("No iteration of this run committed a policy checkpoint: a new run folder starts from the "
                         "initial policy.")
    loose = _refused(str(tmp_path / "loose"), "demo v0")  # not a stage folder of a run: no iteration, no checkpoint
    assert loose.startswith(f"{tmp_path}/loose: this stage was written by an older version") and "policy.path" not in loose
