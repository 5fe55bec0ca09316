"""The training flow's optional W&B logging (a fake ``wandb`` module) and its curve artifact."""
from __future__ import annotations

import asyncio
import sys
import types

from tests.flows.conftest import flow_cfg


def test_train_logs_each_iteration_to_wandb_and_publishes_the_curve(prefect_harness, tiny_model, tmp_path, fake_rewards,
                                                                    monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.train import train
    from rft_core.observe import WandbLogger

    calls: list = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["id"], kw["project"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)

    cfg = flow_cfg(tiny_model, tmp_path / "run", iterations=2, **{"observe.wandb.enabled": True,
                   "observe.wandb.project": "rft-test", "observe.curve_every_s": 0})
    result = train(cfg)
    assert calls[0] == ("init", WandbLogger.run_id(cfg.run_root), "rft-test")
    assert [c[1] for c in calls[1:3]] == [1, 2] and calls[3:] == [("finish",)]
    for (_, step, values), row in zip(calls[1:3], result.metrics):
        assert values["reward_mean"] == row["reward_mean"] and values["kl"] == row["kl"]

    async def curve_versions():
        async with get_client() as client:
            arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["metrics-curve"])))
            return [a.data for a in arts if cfg.run_root in (a.description or "")]

    versions = asyncio.run(curve_versions())
    assert len(versions) == 2  # one per iteration (curve_every_s 0)
    assert all("](data:image/png;base64,iVBORw0KGgo" in v for v in versions)
    assert sorted(v.splitlines()[0] for v in versions) == ["### Metrics over 1 iteration(s)", "### Metrics over 2 iteration(s)"]
