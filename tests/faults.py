"""Fault injection: SIGKILL a training worker (a real subprocess) at a random point inside a
stage, rerun the same training, and check what survived; the run root is a local folder or an
S3 bucket of a real S3-compatible server started here (moto's server mode on 127.0.0.1). Used
by tests/test_faults.py, tests/test_object_storage.py, tests/test_disk_full.py,
tests/test_corruption.py and benchmarks/reliability.py (which writes docs/reliability.md)."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rft_core.agents import StepResult
from rft_core.agents.calculator import CalculatorEnv
from tests.varying import REWARD_YAML

ROOT = Path(__file__).resolve().parents[1]
STAGE_ORDER = ["prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update"]
# the stage whose commit means `stage` can start (actor/ref/rewards start together after the rollout)
PREVIOUS = {"prompts": None, "rollout": "prompts", "actor_logprobs": "rollout", "ref_logprobs": "rollout",
            "rewards": "rollout", "advantages": "rewards", "ppo_update": "advantages",
            # the policy's AdamW state, written in the background after ppo_update commits
            "ppo_update-optimizer": "ppo_update"}


def write_config(path: Path, model: str, iterations: int = 2) -> Path:
    """A tiny training config (2 iterations by default) whose stages take a noticeable time and
    whose rewards vary inside each group (``tests/varying.py``: non-zero advantages, so the final
    weights compared after a kill come from real policy-gradient updates)."""
    path.write_text(f"""
name: faults
iterations: {iterations}
policy: {{path: {model}}}
data: {{prompts_per_iteration: 4, size: 50}}
rollout: {{n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8}}
kl: {{kl_coef: 0.05}}
update: {{lr: 1.0e-3, micro_batch_size: 2, epochs: 2}}
{REWARD_YAML}""")
    return path


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3-compatible server (``moto_server``, from ``moto[server]``) as a subprocess on
    127.0.0.1, with the environment a client needs (endpoint, dummy credentials).

    ``auth_setup_calls``: with a number, the server checks credentials and IAM policies after
    that many unauthenticated set-up calls (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``); None: it
    accepts any credentials.
    """

    def __init__(self, log_dir: Path, *, auth_setup_calls: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"moto-{self.port}.log"
        env = {**os.environ, **self.env()}
        if auth_setup_calls is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(auth_setup_calls)
        exe = Path(sys.executable).with_name("moto_server")
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)], env=env, stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {self.log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.2)

    def env(self) -> dict[str, str]:
        """What a client process needs: the endpoint (botocore's AWS_ENDPOINT_URL) and credentials."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self, service: str = "s3", **kw):
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=kw.pop("key", "testing"),
                            aws_secret_access_key=kw.pop("secret", "testing"), **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _env(api_url: str | None, extra: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PREFECT_LOGGING_LEVEL": "WARNING",
           "COLUMNS": "1000"}  # rich prints tracebacks at that width: no line breaks inside paths
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra or {})
    return env


def start_training(config: Path, run_root: Path | str, api_url: str | None,
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """The worker: the CLI, in its own process group (so the kill takes all its threads)."""
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "-c", str(config), "--run-root", str(run_root)],
                            cwd=ROOT, env=_env(api_url, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _fs(run_root: Path | str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(str(run_root))
    fs.invalidate_cache()
    return fs, path.rstrip("/")


def exists(uri: Path | str) -> bool:
    """Whether the file ``uri`` exists now (local path or any fsspec URI; no stale listing)."""
    if isinstance(uri, Path) or "://" not in uri:
        return Path(uri).exists()
    fs, path = _fs(uri)
    return fs.exists(path)


def snapshot(run_root: Path | str) -> dict[str, tuple]:
    """Every file under the committed stages of the run: local (mtime_ns, sha256); object store
    (ETag, LastModified, sha256)."""
    fs, root = _fs(run_root)
    out = {}
    for manifest in fs.glob(f"{root}/iter=*/*/_MANIFEST.json"):
        for p in fs.find(manifest.rsplit("/", 1)[0]):
            info = fs.info(p)
            sha = hashlib.sha256(fs.cat_file(p)).hexdigest()
            stamp = (os.stat(p).st_mtime_ns,) if "ETag" not in info else (info["ETag"], str(info.get("LastModified")))
            out[p[len(root) + 1:]] = (*stamp, sha)
    return out


def untouched(before: dict[str, tuple], after: dict[str, tuple], run_root: Path | str) -> list[str]:
    """The files of ``before`` that changed or vanished in ``after``, less those that checkpoint
    retention pruned on purpose (recorded in their stage's ``_PRUNED.json``). Empty: untouched."""
    from schemas import pruned_files

    fs, root = _fs(run_root)
    bad = []
    for rel, stamp in before.items():
        if after.get(rel) == stamp:
            continue
        it_dir, stage, sub = rel.split("/", 2)
        if sub in pruned_files(f"{str(run_root).rstrip('/')}/{it_dir}/{stage}"):
            continue
        bad.append(rel)
    return bad


def final_weights(run_root: Path | str, iteration: int = 2) -> torch.Tensor:
    from rft_core.models.loading import load_causal_lm
    from rft_core.stages.checkpoints import policy_model_path
    from schemas import ShardRef

    ref = ShardRef.from_manifest(f"{str(run_root).rstrip('/')}/iter={iteration:06d}/ppo_update")
    model = load_causal_lm(policy_model_path(ref))
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@dataclass
class Outcome:
    """One fault-injection run, as reported in docs/reliability.md."""

    target: str
    iteration: int
    phase: str
    delay: float
    killed: bool
    interrupted: str = ""
    partial_files: bool = False
    committed_before: int = 0
    rerun_ok: bool = False
    committed_untouched: bool = False
    all_valid: bool = False
    same_weights: bool = False
    notes: list[str] = field(default_factory=list)


def _has_files(fs, path: str) -> bool:
    return fs.exists(path) and bool(fs.find(path))


def _interrupted(run_root: Path | str, target: str, iteration: int, out: Outcome) -> None:
    """Fill ``out.interrupted`` and ``out.partial_files``: where the kill landed."""
    fs, root = _fs(run_root)
    for it in (1, 2):
        d = f"{root}/iter={it:06d}"
        if target not in STAGE_ORDER and it == iteration and not fs.exists(f"{d}/{target}/_MANIFEST.json"):
            out.interrupted = f"{it}: {target}"  # a stage outside the main order (the background optimizer write)
            out.partial_files = _has_files(fs, f"{d}/{target}")
            return
        committed = {p.rsplit("/", 2)[-2] for p in fs.glob(f"{d}/*/_MANIFEST.json")}
        pending = [s for s in STAGE_ORDER if s not in committed]
        if pending:
            started = [s for s in pending if _has_files(fs, f"{d}/{s}")]
            out.interrupted = f"{it}: " + (" + ".join(started) if started else f"{pending[0]} (computing, no files yet)")
            out.partial_files = bool(started)
            return
    out.interrupted = "(none: the run had finished)"


def write_resident_config(path: Path, model: str, iterations: int = 3) -> Path:
    """``write_config``'s run with resident workers (issue 27): 3 iterations, a checkpoint every 3,
    so iterations 1 and 2 keep the policy in the workers' memory only."""
    write_config(path, model, iterations)
    path.write_text(path.read_text().replace("name: faults", "name: faults-resident")
                    + "orchestration: {workers: resident}\ncheckpoint: {every: 3}\n")
    return path


def write_async_config(path: Path, model: str, iterations: int = 2) -> Path:
    """``write_config``'s run with ``rollout.max_staleness: 1`` (issue 28): the rollout of
    iteration 2 samples with the initial policy and runs while the update of iteration 1 trains."""
    write_config(path, model, iterations)
    path.write_text(path.read_text().replace("name: faults", "name: faults-async").replace(
        "rollout: {n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8}",
        "rollout: {n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8, max_staleness: 1}"))
    return path


def running_workers() -> list[int]:
    """Pids of the resident workers (Ray actors) that are running a stage program now: their
    process title is ``ray::ModelWorker.run`` while ``ModelWorker.run`` executes."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines() if "ray::ModelWorker.run" in line]


def run_scenario(config: Path, run_root: Path | str, target: str, iteration: int, durations: dict[str, float],
                 baseline: torch.Tensor, api_url: str | None, rng: random.Random, timeout: float = 300,
                 phase: str = "compute", env: dict[str, str] | None = None, kill: str = "driver",
                 final_iteration: int = 2) -> Outcome:
    """Kill the worker inside ``target`` of ``iteration``, rerun, check.

    ``kill="driver"``: SIGKILL the training process's group (the flow, its local Ray and any
    resident workers with it). ``kill="worker"``: SIGKILL only the resident worker running a
    stage program at that moment (``running_workers``); the run replaces it and goes on, and is
    then rerun like the others (which reuses every committed stage). ``final_iteration``: the
    run's last iteration (its weights are compared).

    ``phase="compute"``: a random time after the stage can start (the stage before it committed),
    within 1.2x its measured duration. ``phase="write"``: within 20 ms after the stage took its
    writer lock, i.e. while it writes its parts or checkpoint files. ``run_root`` may be an
    ``s3://`` URI (``env``: the server's endpoint and credentials).
    """
    from schemas import read_shard

    root = str(run_root).rstrip("/")
    it_dir = f"{root}/iter={iteration:06d}"
    prev = PREVIOUS[target]
    if phase == "write":
        trigger, delay = f"{it_dir}/{target}/.writer.lock", rng.uniform(0.0, 0.02)
    else:
        trigger = (f"{it_dir}/{prev}/_MANIFEST.json") if prev else (
            f"{root}/iter={iteration - 1:06d}/ppo_update/_MANIFEST.json" if iteration > 1 else None)
        delay = rng.uniform(0.0, 1.2 * max(durations.get(target, 0.5), 0.2))
    poll = 0.002 if "://" not in root else 0.02
    proc = start_training(config, run_root, api_url, env)
    t0 = time.time()
    while trigger is not None and time.time() - t0 < timeout and proc.poll() is None and not exists(trigger):
        time.sleep(poll)
    time.sleep(delay)
    out = Outcome(target=target, iteration=iteration, phase=phase, delay=round(delay, 3), killed=proc.poll() is None)
    if kill == "worker":
        pids = running_workers() if out.killed else []
        out.killed = bool(pids)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        out.notes.append(f"worker kill: {len(pids)} worker(s)")
        first, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            out.notes.append("the run did not survive the worker kill: " + first.decode(errors="replace")[-2000:])
    elif out.killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _interrupted(run_root, target, iteration, out)
    before = snapshot(run_root)
    out.committed_before = len({"/".join(k.split("/")[:2]) for k in before})
    rerun = start_training(config, run_root, api_url, env)
    log, _ = rerun.communicate(timeout=timeout)
    out.rerun_ok = rerun.returncode == 0
    if not out.rerun_ok:
        out.notes.append(log.decode(errors="replace")[-2000:])
        return out
    changed = untouched(before, snapshot(run_root), run_root)
    out.committed_untouched = not changed
    if changed:
        out.notes.append(f"changed: {changed}")
    try:
        fs, _ = _fs(run_root)
        for manifest in fs.glob(f"{root.split('://', 1)[-1]}/iter=*/*/_MANIFEST.json"):
            stage_dir = manifest.rsplit("/", 1)[0]
            read_shard(f"{root.split('://', 1)[0]}://{stage_dir}" if "://" in root else stage_dir)
        out.all_valid = True
    except Exception as exc:  # reported, and the test fails on it
        out.notes.append(f"invalid shard: {exc}")
    out.same_weights = bool(torch.equal(final_weights(run_root, final_iteration), baseline))
    return out


def baseline_run(config: Path, run_root: Path | str, api_url: str | None,
                 env: dict[str, str] | None = None, final_iteration: int = 2) -> tuple[torch.Tensor, dict[str, float]]:
    """An uninterrupted run: its final weights and each stage's seconds in iteration 1."""
    from schemas import read_manifest

    proc = start_training(config, run_root, api_url, env)
    log, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(log.decode(errors="replace")[-3000:])
    durations = {}
    fs, root = _fs(run_root)
    prefix = f"{str(run_root).split('://', 1)[0]}://" if "://" in str(run_root) else ""
    for m in fs.glob(f"{root}/iter=000001/*/_MANIFEST.json"):
        s = read_manifest(prefix + m.rsplit("/", 1)[0])[0].summary
        durations[m.rsplit("/", 2)[-2]] = float(s.get("seconds", 0.0)) + float(s.get("checkpoint_seconds", 0.0))
    return final_weights(run_root, final_iteration), durations


def write_agent_config(path: Path, model: str, iterations: int = 2) -> Path:
    """``write_config``'s run with a multi-turn rollout (issue 20): the calculator, every model turn
    read as a call (``FaultCalculator``), 3 turns per trajectory."""
    path.write_text(f"""
name: faults-agent
iterations: {iterations}
policy: {{path: {model}}}
data: {{prompts_per_iteration: 4, size: 50}}
rollout:
  n_samples_per_prompt: 4
  batch_size: 8
  agent: {{environment: "tests.faults:FaultCalculator", max_turns: 3, max_total_tokens: 48}}
kl: {{kl_coef: 0.05}}
update: {{lr: 1.0e-3, micro_batch_size: 2, epochs: 2}}
{REWARD_YAML}""")
    return path


class FaultCalculator(CalculatorEnv):
    """The calculator with a scripted call per turn (the tiny model writes gibberish): the call is
    ``<calc>{len(turn text)} * 7</calc>``, a turn ends at its first printable ASCII character, and
    each step takes 0.25 s (so a kill lands among the environment steps)."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.stop_strings = tuple(chr(c) for c in range(33, 127))

    def step(self, text):
        time.sleep(0.25)
        r = super().step(f"<calc>{len(text)} * 7</calc>")
        return StepResult(r.observation, float(len(text) % 2), False, r.info)
