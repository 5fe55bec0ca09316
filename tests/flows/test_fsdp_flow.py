"""FSDP2 through the training flow (issue 47): the run of ``rft train -c configs/grpo_demo.yaml
--set update.fsdp.reshard_after_forward=true --set orchestration.workers=resident --set
orchestration.policy_ranks=2`` on the tiny model (2 iterations, 2 policy ranks as Ray actors,
each weight sync gathered from both) ends with weights within 1e-6 of the same run without
``update.fsdp`` (one process, stage mode). The rewards vary inside each group
(``tests/varying.py``): both runs assert non-zero advantages and a policy gradient first."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from tests.flows.conftest import flow_cfg  # noqa: E402
from tests.varying import REWARD, assert_training_signal  # noqa: E402

FSDP_RESIDENT = {"update.fsdp.reshard_after_forward": True, "orchestration.workers": "resident",
                 "orchestration.policy_ranks": 2}


def _safetensors(result) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{result.final_policy_folder}/model.safetensors")


@pytest.mark.rotation(4)  # long: one turn in 8 (tests/rotation.py; out of group 7, measured at 984 s with it)
def test_resident_fsdp_two_ranks_ends_within_1e6_of_the_run_without_fsdp(prefect_harness, tiny_model, tmp_path):
    from flows.train import train
    from rft_core.models.loading import load_causal_lm
    from schemas import read_manifest, stage_uri

    plain = train(flow_cfg(tiny_model, tmp_path / "plain", **REWARD))
    assert_training_signal(tmp_path / "plain", (1, 2))
    cfg = flow_cfg(tiny_model, tmp_path / "fsdp", **REWARD, **FSDP_RESIDENT)
    sharded = train(cfg)
    assert_training_signal(tmp_path / "fsdp", (1, 2))
    m, _ = read_manifest(stage_uri(cfg.run_root, 2, "ppo_update"))
    assert m.summary["world_size"] == 2 and m.summary["sharding"] == "fsdp2"
    assert read_manifest(stage_uri(cfg.run_root, 2, "ppo_update-optimizer"))[0].summary["format"] == "fsdp"
    # update 1 synced ahead to the rollout worker, before iteration 2's rollout asked for it
    assert [r.get("run/weight_syncs", 0) for r in sharded.metrics] == [1, 1]
    a, b = _safetensors(plain), _safetensors(sharded)
    init = load_causal_lm(tiny_model).state_dict()
    assert a.keys() == b.keys()
    assert max((a[k] - init[k]).abs().max().item() for k in a) > 1e-3  # two updates moved the weights
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-6, diff


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_resident_fsdp_lora_in_bfloat16_ends_within_1e6_of_the_stage_mode_run(prefect_harness, tiny_model, tmp_path):
    """``update.lora`` on a bfloat16 base with FSDP2 on 2 resident ranks: each sync moves the
    float32 adapters alone, gathered from both ranks (``run/weight_sync_bytes``: 2 layers x rank
    4 x 512 in+out features x 4 bytes), and the run ends with adapters within 1e-6 of the same
    run in stage mode in one process (whose passes keep the adapters on the bfloat16 base too)."""
    from safetensors.torch import load_file

    from flows.train import train

    lora = {"policy.dtype": "bfloat16", "update.lora.rank": 4, "update.lora.alpha": 8}
    plain = train(flow_cfg(tiny_model, tmp_path / "plain", **REWARD, **lora))
    assert_training_signal(tmp_path / "plain", (1, 2))
    sharded = train(flow_cfg(tiny_model, tmp_path / "fsdp", **REWARD, **lora, **FSDP_RESIDENT))
    assert_training_signal(tmp_path / "fsdp", (1, 2))
    assert [r.get("run/weight_sync_bytes", 0) for r in sharded.metrics] == [2 * 4 * 512 * 4] * 2
    a, b = (load_file(f"{r.final_policy_folder}/adapter_model.safetensors") for r in (plain, sharded))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 1e-4  # the adapters moved from 0
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-6, diff
