"""The deployments of prefect.yaml against a real Prefect server, as a user runs them.

`python -m flows.cli serve` (a subprocess) starts `prefect server start` on a free port of
127.0.0.1 with its own PREFECT_HOME, creates the `local` process work pool and the `gpu`
concurrency limit, runs `prefect deploy --all` and starts a worker. Then:

* the training deployment runs with tiny settings (a tiny random model saved to a temp folder,
  the preset's real rewards) and completes; its artifacts are on the server and its
  `gpu`-tagged stages never overlapped;
* a second run fails in a stage on purpose (its reference model folder is missing), the
  folder is put in place, the flow run is set to AwaitingRetry through the API exactly as the
  UI's Retry button does (``retryFlowRun`` in the UI bundle: state SCHEDULED named
  AwaitingRetry, message "Retry from the UI", force=False), and the worker's retry completes
  while every committed stage file keeps its mtime and checksum;
* the replay deployment replays the first run;
* two `gpu`-tagged tasks overlap without the tag concurrency limit and run one after the other
  with `prefect concurrency-limit create gpu 1`.

Everything started here (serve, and through it the server and the worker) is stopped at the
end, also on failure.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rft_core.network import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)

TINY = {"iterations": 1, "data.prompts_per_iteration": 2, "data.size": 20, "rollout.n_samples_per_prompt": 2,
        "rollout.max_new_tokens": 4, "rollout.batch_size": 4, "update.micro_batch_size": 4, "kl.kl_coef": 0.05,
        "logprobs.recompute_old_logprobs": True}
COMMITTED_BEFORE_FAILURE = ["prompts", "rollout", "rewards", "actor_logprobs"]


def _env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               # no cron runs of the nightly deployment during the test
               PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false", PREFECT_LOGGING_LEVEL="INFO",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


class Stack:
    """The `serve` subprocess and what it reported."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.home = tmp / "prefect-home"
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.log = tmp / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []

    def start(self, timeout_s: float = 300) -> None:
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "serve", "--port", str(self.port), "--poll-seconds", "1"],
                cwd=ROOT, env=_env(self.home), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "stop:" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"serve did not come up (exit {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.5)
        self.pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", self.text())]

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM serve (it stops its worker and server), then make sure all three are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for pid in self.pids:  # the server's and the worker's process groups, should serve have died hard
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("deploy"))
    try:
        s.start()
        yield s
    finally:
        s.stop()
    with pytest.raises(OSError):  # the server is gone: nothing listens on its port any more
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


@pytest.fixture(scope="module")
def client(stack):
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api=stack.api_url) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_model_dir(stack) -> str:
    from tests.tiny import build_tiny_model

    return build_tiny_model(stack.tmp / "tiny")


def _wait_final(client, stack, flow_run_id, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while True:
        fr = client.read_flow_run(flow_run_id)
        if fr.state is not None and fr.state.is_final():
            return fr
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {fr.name} still {fr.state and fr.state.name} after {timeout_s} s; "
                                 f"serve output:\n{stack.text()[-4000:]}")
        time.sleep(1)


def _run_deployment(client, name: str, **parameters):
    dep = client.read_deployment_by_name(name)
    return client.create_flow_run_from_deployment(dep.id, parameters=parameters)


def _snapshot(run_root: Path, stages: list[str]) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(run_root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for stage in stages for p in sorted((run_root / "iter=000001" / stage).rglob("*")) if p.is_file()}


def _committed(run_root: Path, stage: str, iteration: int = 1) -> bool:
    return (run_root / f"iter={iteration:06d}" / stage / "_MANIFEST.json").is_file()


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 941 s with it)
def test_serve_deployed_everything(stack, client):
    from flows.serve import deployment_names

    assert {"rft-eval-preset/eval", "rft-replay-preset/replay", "rft-train-preset/grpo-demo",
            "rft-train-preset/grpo-nightly"} <= set(deployment_names(stack.api_url))
    assert client.read_work_pool("local").type == "process"
    assert client.read_concurrency_limit_by_tag("gpu").concurrency_limit == 1
    nightly = client.read_deployment_by_name("rft-train-preset/grpo-nightly")
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "UTC", True)
    assert nightly.parameters["overrides"]["run_root"] == "runs/nightly-{timestamp}"
    demo = client.read_deployment_by_name("rft-train-preset/grpo-demo")
    # the flow runs in the repository (the pull step resolved $PWD at deploy time)
    assert demo.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert demo.job_variables["env"]["TOKENIZERS_PARALLELISM"] == "false"


@pytest.mark.rotation(6)  # long: one turn in 8 (tests/rotation.py; its siblings in 5: both groups start the stack)
def test_train_deployment_then_fail_and_retry_from_the_ui(stack, client, tiny_model_dir):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, TaskRunFilter, TaskRunFilterTags
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import State

    # 1. a tiny training run through the deployment completes
    run_a = stack.tmp / "run-a"
    fr = _run_deployment(client, "rft-train-preset/grpo-demo",
                         overrides={**TINY, "name": "deploy-a", "run_root": str(run_a), "policy.path": tiny_model_dir})
    fr = _wait_final(client, stack, fr.id)
    assert fr.state.type == StateType.COMPLETED, fr.state.message
    assert all(_committed(run_a, s) for s in COMMITTED_BEFORE_FAILURE + ["ref_logprobs", "advantages", "ppo_update"])
    assert [json.loads(x)["iteration"] for x in (run_a / "metrics.jsonl").read_text().splitlines()] == [1]
    # its artifacts: metrics table, samples, and the curve as an embedded PNG
    arts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
        any_=["metrics-curve", "training-metrics", "samples-iter-000001", "metrics-iter-000001"])))}
    assert set(arts) == {"metrics-curve", "training-metrics", "samples-iter-000001", "metrics-iter-000001"}
    assert arts["metrics-curve"].type == "markdown" and "](data:image/png;base64,iVBORw0KGgo" in arts["metrics-curve"].data
    # with `gpu` limited to 1 slot, no two model-holding stages of one flow run overlapped
    gpu_runs = client.read_task_runs(task_run_filter=TaskRunFilter(tags=TaskRunFilterTags(all_=["gpu"])))
    by_flow: dict = {}
    for tr in gpu_runs:
        if tr.name.startswith("hold"):  # test_gpu_tag_concurrency_limit's own tasks
            continue
        by_flow.setdefault(tr.flow_run_id, []).append((tr.start_time, tr.end_time, tr.name))
    iteration_runs = [sorted(v) for v in by_flow.values()]
    assert max(len(v) for v in iteration_runs) >= 4  # rollout, actor_logprobs, ref_logprobs, ppo_update
    for spans in iteration_runs:
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            assert start >= end, f"{a} and {b} overlapped"

    # 2. a run whose reference model folder is missing: ref_logprobs fails, the flow run fails
    run_b, reference = stack.tmp / "run-b", stack.tmp / "reference"
    fr = _run_deployment(client, "rft-train-preset/grpo-demo",
                         overrides={**TINY, "name": "deploy-b", "run_root": str(run_b), "policy.path": tiny_model_dir,
                                    "reference.path": str(reference)})
    fr = _wait_final(client, stack, fr.id)
    assert fr.state.type == StateType.FAILED and "ModelLoadError" in fr.state.message, fr.state.message
    assert str(reference) in fr.state.message
    assert all(_committed(run_b, s) for s in COMMITTED_BEFORE_FAILURE)
    assert not any(_committed(run_b, s) for s in ("ref_logprobs", "advantages", "ppo_update"))
    before = _snapshot(run_b, COMMITTED_BEFORE_FAILURE)
    assert len(before) >= 8  # a part file and a manifest per stage at least

    # 3. fix the cause, press "Retry" (the UI's call), the worker reruns the flow run
    shutil.copytree(tiny_model_dir, reference)
    result = client.set_flow_run_state(fr.id, State(type=StateType.SCHEDULED, name="AwaitingRetry",
                                                    message="Retry from the UI"), force=False)
    assert result.status == SetStateStatus.ACCEPT, result.details
    fr = _wait_final(client, stack, fr.id)
    assert fr.state.type == StateType.COMPLETED, fr.state.message
    assert fr.run_count == 2
    # the run's state history: it failed, was set to AwaitingRetry, ran again in the worker, completed
    history = [s.name for s in client.read_flow_run_states(fr.id)]
    after_retry = history[history.index("AwaitingRetry"):]
    assert history.index("Failed") < history.index("AwaitingRetry"), history
    assert after_retry[-1] == "Completed" and "Running" in after_retry and "Failed" not in after_retry, history
    assert _snapshot(run_b, COMMITTED_BEFORE_FAILURE) == before  # reused: same files, same mtimes
    assert all(_committed(run_b, s) for s in ("ref_logprobs", "advantages", "ppo_update"))

    # 4. the replay deployment replays run A with another estimator, generating nothing
    replay_root = stack.tmp / "replay"
    fr = _run_deployment(client, "rft-replay-preset/replay", source_run_root=str(run_a), run_root=str(replay_root),
                         overrides={**TINY, "policy.path": tiny_model_dir, "advantage.estimator": "rloo"})
    fr = _wait_final(client, stack, fr.id)
    assert fr.state.type == StateType.COMPLETED, fr.state.message
    assert json.loads((replay_root / "_REPLAY.json").read_text())["source_run_root"] == str(run_a)
    assert _committed(replay_root, "advantages") and _committed(replay_root, "ppo_update")
    assert not (replay_root / "iter=000001" / "rollout").exists()


def _intervals(stack, seconds: float = 1.5) -> list[tuple[float, float]]:
    out = subprocess.run([sys.executable, "-m", "tests.flows.gpu_overlap", str(seconds)], cwd=ROOT,
                         env=_env(stack.home, stack.api_url), capture_output=True, text=True, timeout=180)
    line = [x for x in out.stdout.splitlines() if x.startswith("INTERVALS ")]
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-2000:]
    return sorted(tuple(x) for x in json.loads(line[0].split(" ", 1)[1]))


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 941 s with it)
def test_gpu_tag_concurrency_limit_serialises_gpu_tasks(stack):
    env = _env(stack.home, stack.api_url)
    prefect = [sys.executable, "-m", "prefect"]
    subprocess.run(prefect + ["concurrency-limit", "delete", "gpu"], env=env, cwd=ROOT, capture_output=True, check=True)
    (s1, e1), (s2, e2) = _intervals(stack)
    assert s2 < e1  # no limit: both held their "device" at the same time
    subprocess.run(prefect + ["concurrency-limit", "create", "gpu", "1"], env=env, cwd=ROOT, capture_output=True, check=True)
    (s1, e1), (s2, e2) = _intervals(stack)
    assert s2 >= e1 and e1 - s1 >= 1.5  # one at a time


@pytest.mark.rotation(5)  # long: one turn in 8 (tests/rotation.py; out of group 6, measured at 941 s with it)
def test_serve_names_a_taken_port(tmp_path, monkeypatch):
    """Something that is not a Prefect server holds the port: a clear error, nothing left running."""
    from flows.serve import ServeError, start_stack

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(ServeError, match=rf"prefect server start exited with \d+ \(port {port} in use\?\)"):
            start_stack("127.0.0.1", port, log_dir=tmp_path / "logs", echo=lambda _: None, server_timeout_s=120)
