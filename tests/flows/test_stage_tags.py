"""Stage task tags: untagged unless wanted (a tagged task costs a concurrency-slot round trip),
`gpu` on model-holding stages and `cpu` on the others when on; auto turns them on exactly when
the server has a `gpu`/`cpu` tag concurrency limit."""
from __future__ import annotations

import pytest

import tasks
from tests.flows.conftest import flow_cfg


def test_stage_tasks_tag_by_stage_kind():
    for task in tasks.STAGE_TASKS:
        assert tasks.tagged(task, False) is task and not task.tags
        on = tasks.tagged(task, True)
        assert on.tags == ({"gpu"} if task.name in tasks.DEVICE_STAGES else {"cpu"}) and on.fn is task.fn
    assert {t.name for t in tasks.STAGE_TASKS if tasks.tagged(t, True).tags == {"gpu"}} == {
        "rollout", "actor_logprobs", "ref_logprobs", "critic_values", "critic_update", "ppo_update", "eval_generate",
        "teacher_logprobs"}
    assert tasks.resolve_concurrency_tags(True) is True and tasks.resolve_concurrency_tags(False) is False


@pytest.mark.rotation(3)  # long: one turn in 8 (tests/rotation.py)
def test_auto_tags_follow_the_servers_tag_limits(prefect_harness, tiny_model, tmp_path, fake_rewards):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter

    from flows.train import train

    def stage_tags(run_name: str) -> dict[str, set]:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])))
            subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id={"any_": [runs[0].id]}))
            trs = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id={"any_": [f.id for f in subflows]}))
            return {tr.name.rsplit("-", 1)[0]: set(tr.tags) for tr in trs}

    with get_client(sync_client=True) as client:
        assert tasks.server_has_tag_limits() is False
        train(flow_cfg(tiny_model, tmp_path / "a", iterations=1, name="tags-off"))
        untagged = stage_tags("tags-off")
        assert {"prompts", "rollout", "ppo_update"} <= set(untagged) and all(not t for t in untagged.values())

        client.create_concurrency_limit(tag="gpu", concurrency_limit=1)
        try:
            assert tasks.server_has_tag_limits() is True
            train(flow_cfg(tiny_model, tmp_path / "b", iterations=1, name="tags-on"))
            tagged = stage_tags("tags-on")
        finally:
            client.delete_concurrency_limit_by_tag("gpu")
    assert tagged["rollout"] == tagged["ppo_update"] == tagged["ref_logprobs"] == {"gpu"}
    assert tagged["prompts"] == tagged["advantages"] == {"cpu"}
    assert tasks.server_has_tag_limits() is False
