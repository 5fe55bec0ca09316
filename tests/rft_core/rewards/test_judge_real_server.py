"""The llm_judge against a real OpenAI-compatible server on the CPU: ``transformers serve``
(Hugging Face transformers' own chat-completions server, installed with transformers; fastapi
and uvicorn come with prefect) serving the embedded default model, SmolLM2-135M-Instruct. The
server is started and stopped by the test; the client is the official ``openai`` one.

(llama.cpp's server through ``llama-cpp-python[server]`` would load the default GGUF directly,
but PyPI has no wheel of it: every fresh install would compile llama.cpp.)"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from rft_core import stages
from rft_core.config import load_config
from rft_core.models.hub import ensure_default_model
from rft_core.rewards.judge import VERDICTS_FOLDER, VerdictParseError, parse_score
from rft_core.stages.contracts import RewardsInput
from schemas import read_manifest, read_shard
from tests.rft_core.rewards.test_rewards_judge import _shards

pytestmark = pytest.mark.slow

SERVE = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, log_path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", model, "--device", "cpu", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300  # a few seconds on a quiet machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"transformers serve exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise AssertionError(f"transformers serve did not answer on port {port}: {log_path.read_text()[-2000:]}")


@pytest.mark.rotation(6)  # long: one turn in 8 (tests/rotation.py); test_judge_flow.py (stand-in) runs every time
def test_a_real_server_judges_each_sample_and_a_rerun_with_it_stopped_completes(tmp_path, monkeypatch):
    model = str(ensure_default_model())
    proc, base_url = _start(model, tmp_path / "serve.log")
    reward = load_config(None, {
        "reward.sources": {"judge": {
            "type": "llm_judge", "base_url": base_url, "model": model, "api_key_env": None, "max_tokens": 8,
            "max_retries": 0, "max_concurrency": 1, "timeout_s": 300, "parse": "label", "labels": {"yes": 1.0, "no": 0.0}, "on_error": "fallback",
            "fallback": 0.5, "template": "Question: {question}\nGiven answer: {response}\nCorrect answer: {reference}\n"
                                         "Is the given answer correct? Reply yes or no."}},
        "reward.recipes": {"a": [{"source": "judge"}]}}).reward
    p, r = _shards(tmp_path, responses=["4", "five", "2+2 is 4"])
    inp = RewardsInput(rollout=r, prompts=p, reward=reward, out=str(tmp_path / "run/iter=000001/rewards"))

    def killed(table):  # the stage dies after its verdicts, before its commit
        raise RuntimeError("killed before the commit")

    try:
        with monkeypatch.context() as m:
            m.setattr(stages.rewards, "rewards_summary", killed)
            with pytest.raises(RuntimeError, match="killed before the commit"):
                stages.rewards.run(inp)
    finally:
        proc.kill()  # the server stops (uvicorn's graceful stop would wait for requests in flight)
        proc.wait(30)
    assert len(list((tmp_path / "run" / VERDICTS_FOLDER).glob("*/*.json"))) == 3

    # the server is gone: the rerun completes from the stored verdicts
    ref = stages.rewards.run(inp)
    rows = read_shard(ref, stage="rewards").to_pylist()
    cfg = reward.sources["judge"]
    for row in rows:
        (v,) = row["judge_verdicts"]
        assert v["served_model"] == model and v["endpoint"] == base_url and v["error"] is None
        assert isinstance(v["reply"], str) and v["reply"].strip() and v["finish_reason"] in ("stop", "length")
        metrics = dict(row["reward_metrics"])
        try:
            want = parse_score(v["reply"], cfg)
        except VerdictParseError:  # the 135M judge said neither yes nor no: the recorded fallback
            assert (row["rewards"], v["score"], metrics["judge.fallback"]) == (0.5, None, 1.0)
        else:
            assert (row["rewards"], v["score"], "judge.fallback" in metrics) == (want, want, False)
    judge = read_manifest(ref.uri)[0].summary["reward_sources"]["judge"]
    assert (judge["n"], judge["judge_requests"], judge["judge_stored"]) == (3, 0, 3)
