"""Scale features inside the flow: stage programs run as subprocesses, LoRA iterations."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rft_core.models.loading import load_causal_lm
from schemas import read_manifest
from tests.flows.conftest import flow_cfg
from tests.varying import REWARD, assert_training_signal
from tests.weights import iteration_policy_files, iteration_policy_folder


def _parts(root: Path, stage: str) -> dict[str, str]:
    """{path: manifest checksum} of the Parquet parts of iteration 1's ``stage``."""
    m, _ = read_manifest(str(root / "iter=000001" / stage))
    return {f.path: f.checksum for f in m.files if not f.path.startswith("policy/")}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.rotation(7)  # long: one turn in 8 (tests/rotation.py)
def test_subprocess_runners_commit_what_the_in_process_flow_commits(prefect_harness, tiny_model, tmp_path):
    from flows.train import train

    sub = {"mode": "subprocess"}
    base = flow_cfg(tiny_model, tmp_path / "inproc", iterations=1, **REWARD)
    a = train(base)
    assert_training_signal(a.run_root, (1,))  # rewards vary in each group: the update has a policy gradient
    cfg = flow_cfg(tiny_model, tmp_path / "sub", iterations=1, **REWARD,
                   runners={"rollout": sub, "actor_logprobs": sub, "ref_logprobs": sub, "ppo_update": sub})
    collect = _Collect()
    task_logger = logging.getLogger("prefect.task_runs")  # prefect's loggers do not propagate to caplog
    task_logger.addHandler(collect)
    try:
        b = train(cfg)
    finally:
        task_logger.removeHandler(collect)
    for stage in ("rollout", "actor_logprobs", "ref_logprobs", "ppo_update"):
        assert _parts(Path(b.run_root), stage) == _parts(Path(a.run_root), stage), stage
    # the in-process update kept its trainer and wrote the weights in the background (ppo_update-policy),
    # the subprocess wrote them in its own stage: the same files
    assert (Path(a.run_root) / "iter=000001/ppo_update-policy").is_dir()
    assert not (Path(b.run_root) / "iter=000001/ppo_update-policy").exists()
    assert iteration_policy_files(b.run_root, 1) == iteration_policy_files(a.run_root, 1)
    wa = load_causal_lm(a.final_policy_folder).state_dict()
    wb = load_causal_lm(b.final_policy_folder).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the subprocesses' own log lines reached the task run loggers
    assert any("rft_core.stages: ppo_update committed" in m for m in collect.messages), collect.messages[-20:]


def test_lora_iterations_checkpoint_adapters_and_load_them_next_iteration(prefect_harness, tiny_model, tmp_path,
                                                                          fake_rewards):
    import json

    from flows.train import train
    from rft_core.models.lora import load_adapter_policy

    cfg = flow_cfg(tiny_model, tmp_path / "lora", iterations=2, **{"update.lora": {"rank": 4, "alpha": 8},
                                                                   "update.lr": 1e-2, "update.packing": True,
                                                                   "logprobs.packing": True})
    result = train(cfg)
    root = Path(result.run_root)
    adapters = []
    for it in (1, 2):
        policy = iteration_policy_folder(root, it)
        assert (policy / "adapter_model.safetensors").exists() and not (policy / "model.safetensors").exists()
        assert json.loads((policy / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model
        adapters.append(load_adapter_policy(policy))
    # iteration 2 continued iteration 1's adapter (its manifest names that checkpoint) and moved it
    m2, _ = read_manifest(str(root / "iter=000002/ppo_update"))
    assert m2.inputs["policy"] == read_manifest(str(root / "iter=000001/ppo_update"))[1]
    w1 = {n: p for n, p in adapters[0].named_parameters() if "lora_B" in n}
    w2 = {n: p for n, p in adapters[1].named_parameters() if "lora_B" in n}
    assert any(p.abs().max() > 0 for p in w1.values()) and any(not torch.equal(w1[n], w2[n]) for n in w1)
    # the base weights stayed as they were
    base = load_causal_lm(tiny_model).state_dict()
    inner = adapters[1].get_base_model().state_dict()
    assert all(torch.equal(base[k], inner[k]) for k in base if k in inner)
