"""Session fixtures shared by the multi-rank update tests (test_deepspeed_update.py,
test_fsdp_update.py): the inputs, the single-process chain and the DeepSpeed chains are built
once per session, whichever module asks first."""
from __future__ import annotations

import pytest

from tests.rft_core.training.chain import ITERATIONS, RUNNER, build_update_inputs, ds, one_thread, run_update


@pytest.fixture(scope="session")
def update_inputs(tiny_model, tmp_path_factory):
    """``chain.build_update_inputs``: a rollout of 10 samples, +-1 advantages, the first single-process update."""
    return build_update_inputs(tiny_model, tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="session")
def single_chain(update_inputs):
    """ITERATIONS single-process updates on the same shards, each from the previous one's policy and
    optimizer stage (the first is the fixture's update)."""
    cfg, chain = update_inputs[3], [update_inputs[4]]
    with one_thread():
        for i in range(2, ITERATIONS + 1):
            chain.append(run_update(update_inputs, chain[-1], cfg, f"single{i}"))
    return chain


@pytest.fixture(scope="session")
def ds_chain(update_inputs, tiny_model):
    """ZeRO stage -> (refs, log lines of each update): ITERATIONS DeepSpeed updates on 2 ranks, each a
    torchrun job from the previous one's committed policy and optimizer stage; each chain built once."""
    pytest.importorskip("deepspeed")
    built: dict[int, tuple[list, list[list[str]]]] = {}

    def chain(zero_stage: int):
        if zero_stage not in built:
            refs, logs, policy = [], [], tiny_model
            for i in range(1, ITERATIONS + 1):
                lines: list[str] = []
                policy = run_update(update_inputs, policy, ds(update_inputs[3], zero_stage), f"zero{zero_stage}-{i}",
                                    RUNNER, lines)
                refs.append(policy)
                logs.append(lines)
            built[zero_stage] = (refs, logs)
        return built[zero_stage]

    return chain
