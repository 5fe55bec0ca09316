"""Fault injection: SIGKILL a training worker (a real subprocess) at a random point inside a
stage, rerun the same training, and check what survived; the run root is a local folder or an
S3 bucket of a real S3-compatible server started here (moto's server mode on 127.0.0.1). Used
by tests/test_faults.py, tests/test_object_storage.py, tests/test_disk_full.py,
tests/test_corruption.py and benchmarks/reliability.py (which writes docs/reliability.md)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from rft_core.agents import StepResult
from rft_core.agents.calculator import CalculatorEnv
from rft_core.config import load_config
from rft_core.network import free_port
from rft_core.stages.partial import CONTINUING_LINE
from rft_core.workers.pool import WORKER_CLASSES
from tests.rotation import GROUPS, assign, caller_module
from tests.varying import REWARD_YAML

ROOT = Path(__file__).resolve().parents[1]
STAGE_ORDER = ["prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update"]
# the stages of the same iteration whose commits let ``stage`` start (none: the prompts, which the
# flow submits once the previous iteration's advantages commit, to run beside its update:
# flows/iteration.py's ``_prompts_ahead``; actor, reference and rewards start together after the
# rollout)
PREDECESSORS = {"prompts": (), "rollout": ("prompts",), "actor_logprobs": ("rollout",), "ref_logprobs": ("rollout",),
                "rewards": ("rollout",), "advantages": ("actor_logprobs", "ref_logprobs", "rewards", "critic_values"),
                "ppo_update": ("advantages",),
                # a GAE run's critic: its values beside the log-prob passes, its update after the advantages
                "critic_values": ("rollout",), "critic_update": ("advantages",),
                # the policy's AdamW state, written in the background after ppo_update commits
                "ppo_update-optimizer": ("ppo_update",),
                # a resident checkpoint iteration's weights, written in the background after that state
                "ppo_update-policy": ("ppo_update-optimizer",)}
# A worker kill picks its victim by the pid the driver logged for the worker of the target's role
# (rank 0: rft_core/workers/pool.py's "resident worker <role> of <pool>: node ..., pid <pid>, ...";
# the last such line, so a replaced worker's), kills it only while its process title says it runs
# a stage program, and then checks the driver's own log line ("the <role> worker died during
# <program>", rft_core/workers/pool.py), so a wrong pick fails the row. The run starts its workers
# together (rft_core.workers.pool.start_run_workers): their start order says nothing.
ROLE_OF_STAGE = {"rollout": "rollout", "actor_logprobs": "rollout", "ref_logprobs": "reference", "ppo_update": "policy",
                 "critic_values": "critic", "critic_update": "critic"}


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


# The write phase of a Parquet stage (prompts to advantages) lasts a few milliseconds: a kill sent
# when its writer lock appears mostly comes after its manifest. Its rows therefore run the CLI with
# the writer paused WRITE_PAUSE_SECONDS between its parts and its manifest (``write_pause``): the
# kill lands while the stage holds its lock with its parts written and no manifest, a state a kill
# of the unpaused writer reaches too, only by chance. ppo_update's checkpoint and the optimizer
# state's background write take long enough to be hit unpaused.
# ppo_update too: with its weights written in the background (checkpoint.async_weights, stage mode's
# default) it commits one small Parquet part and its manifest within a few ms, as the others do
PAUSED_WRITES = ("prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update")
WRITE_PAUSE_ENV = "RFT_FAULTS_WRITE_PAUSE"
WRITE_PAUSE_SECONDS = 5.0
# a worker kill that finds the worker between stage programs waits this long for it to run one
WORKER_WAIT_S = 5.0


def cli_with_write_pause() -> None:
    """``python -m flows.cli`` (arguments from ``sys.argv``) whose ``schemas.tables.write_parts``
    sleeps after writing the parts of one stage folder, given by the environment variable
    ``WRITE_PAUSE_ENV`` as ``iter=NNNNNN/<stage>@<seconds>``; every other write is untouched."""
    import runpy

    import schemas.tables as tables

    folder, seconds = os.environ[WRITE_PAUSE_ENV].rsplit("@", 1)
    real = tables.write_parts

    def write_parts(table, uri, **kw):
        rows = real(table, uri, **kw)
        if uri.rstrip("/").endswith("/" + folder):
            time.sleep(float(seconds))
        return rows

    # every module holding the real function by name: write_shard's (schemas.tables), and those
    # imported already (this module imports rft_core.stages.common, the update's commit, before
    # the patch: patching only ``schemas`` left ppo_update's write unpaused, and its rows landed by
    # chance, in up to 3 tries); a module imported later takes ``schemas``' patched one
    for module in [m for m in list(sys.modules.values()) if m is not None]:
        if getattr(module, "write_parts", None) is real:
            module.write_parts = write_parts
    sys.argv[0] = "rft"
    runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)


def start_training(config: Path, run_root: Path | str, api_url: str | None,
                   env: dict[str, str] | None = None, write_pause: str | None = None) -> subprocess.Popen:
    """The worker: the CLI, in its own process group (so the kill takes all its threads).
    ``write_pause``: ``iter=NNNNNN/<stage>@<seconds>``, run through ``cli_with_write_pause``."""
    cli = ["-m", "flows.cli"]
    if write_pause:
        cli = ["-c", "from tests.faults import cli_with_write_pause; cli_with_write_pause()"]
        env = {**(env or {}), WRITE_PAUSE_ENV: write_pause}
    return subprocess.Popen([sys.executable, *cli, "train", "-c", str(config), "--run-root", str(run_root)],
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
    """One fault-injection run, as reported in docs/reliability.md.

    ``killed``: a SIGKILL was sent (to the driver's process group, or to a resident worker that
    was running a stage program). ``landed``: the committed manifests right after the kill show
    it where the row names it: ``target`` of ``iteration`` (and ``also``, for an overlap row) not
    committed, every stage it waits for committed (``PREDECESSORS``), its writer lock taken for a
    kill in the write phase, and for a worker kill the driver's log names the worker and the
    stage. ``overlap_live``: for an overlap row, both stages of the pair were in flight at the
    kill: every stage each of them waits for had committed (so the flow had submitted both; it
    submits a stage as soon as its inputs commit) and neither had committed. ``redone``: after
    the rerun (or, for a worker kill, the run that replaced the worker) the interrupted stage(s)
    are committed by a manifest written after the kill. ``attempts``: kills tried; a kill that
    would miss (the stage committed first, or no worker was running it) is not sent and the row
    is tried again from scratch with a shorter delay, at most 3 times. ``write_paused``: the
    writer was paused between its parts and its manifest (``PAUSED_WRITES``). ``run_root``: the
    run root of the last try (``-retryN`` after the first); ``kill``: ``driver`` or ``worker``;
    ``also``: the other stage of an overlap row, as (stage, iteration). ``rerun_started``: when
    the rerun was started (time.time()).
    """

    target: str
    iteration: int
    phase: str
    delay: float
    killed: bool
    run_root: str = ""
    kill: str = "driver"
    also: tuple[str, int] | None = None
    interrupted: str = ""
    partial_files: bool = False
    committed_before: int = 0
    rerun_ok: bool = False
    committed_untouched: bool = False
    all_valid: bool = False
    same_weights: bool = False
    landed: bool = False
    overlap_live: bool | None = None
    redone: bool = False
    rerun_started: float = 0.0
    rerun_log: str = field(default="", repr=False)  # the rerun's output (its last 50,000 characters)
    attempts: int = 0
    write_paused: bool = False
    kill_time: float = 0.0
    line_at: float | None = None  # when the driver printed ``after_line`` (run_scenario), before the kill
    committed_at_kill: set = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)  # the notes of the tries before this one: why they missed


def _has_files(fs, path: str) -> bool:
    return fs.exists(path) and bool(fs.find(path))


def committed(run_root: Path | str) -> set[tuple[int, str]]:
    """(iteration, stage) of every committed stage of the run (a ``_MANIFEST.json`` present now)."""
    fs, root = _fs(run_root)
    out = set()
    for m in fs.glob(f"{root}/iter=*/*/_MANIFEST.json"):
        it_dir, stage = m.rsplit("/", 3)[-3:-1]
        out.add((int(it_dir.split("=")[1]), stage))
    return out


def _interrupted(run_root: Path | str, target: str, iteration: int, out: Outcome) -> None:
    """Fill ``out.interrupted`` and ``out.partial_files``: where the kill landed."""
    fs, root = _fs(run_root)
    iterations = sorted({it for it, _ in committed(run_root)} | {iteration})
    for it in iterations:
        d = f"{root}/iter={it:06d}"
        if target not in STAGE_ORDER and it == iteration and not fs.exists(f"{d}/{target}/_MANIFEST.json"):
            out.interrupted = f"{it}: {target}"  # a stage outside the main order (the background optimizer write)
            out.partial_files = _has_files(fs, f"{d}/{target}")
            return
        done = {p.rsplit("/", 2)[-2] for p in fs.glob(f"{d}/*/_MANIFEST.json")}
        pending = [s for s in STAGE_ORDER if s not in done]
        if pending:
            started = [s for s in pending if _has_files(fs, f"{d}/{s}")]
            out.interrupted = f"{it}: " + (" + ".join(started) if started else f"{pending[0]} (computing, no files yet)")
            out.partial_files = bool(started)
            return
    out.interrupted = "(none: the run had finished)"


def write_resident_config(path: Path, model: str, iterations: int = 3, *, stage: bool = False) -> Path:
    """``write_config``'s run with resident workers (issue 27): 3 iterations, a checkpoint every 3,
    so iterations 1 and 2 keep the policy in the workers' memory only. ``stage``: the same run in
    stage mode (every stage loads its model, a checkpoint every iteration), what the resident run
    must equal."""
    write_config(path, model, iterations)
    text = path.read_text().replace("name: faults", "name: faults-resident")
    path.write_text(text if stage else text + "orchestration: {workers: resident}\ncheckpoint: {every: 3}\n")
    return path


def write_async_config(path: Path, model: str, iterations: int = 2) -> Path:
    """``write_config``'s run with ``rollout.max_staleness: 1`` (issue 28): the rollout of
    iteration 2 samples with the initial policy and runs while the update of iteration 1 trains."""
    write_config(path, model, iterations)
    path.write_text(path.read_text().replace("name: faults", "name: faults-async").replace(
        "rollout: {n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8}",
        "rollout: {n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8, max_staleness: 1}"))
    return path


def write_fsdp_config(path: Path, model: str) -> Path:
    """``write_resident_config``'s run with FSDP2 over 2 policy ranks (issue 47), 16 new tokens
    instead of 48 (two ranks per update, and ``baseline_run``'s 10 min on a loaded machine)."""
    write_resident_config(path, model)
    text = path.read_text()
    assert "update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2}" in text
    path.write_text(text.replace("update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2}",
                                 "update: {lr: 1.0e-3, micro_batch_size: 2, epochs: 2, fsdp: {reshard_after_forward: true}}")
                    .replace("orchestration: {workers: resident}", "orchestration: {workers: resident, policy_ranks: 2}")
                    .replace("name: faults-resident", "name: faults-fsdp")
                    .replace("max_new_tokens: 48", "max_new_tokens: 16"))
    return path


def write_critic_gang_config(path: Path, model: str) -> Path:
    """``write_resident_config``'s run as PPO with GAE and an FSDP2 critic held by a resident gang of
    2 ranks (``orchestration.critic_ranks: 2``), 16 new tokens instead of 48 (as
    ``write_fsdp_config``): the critic's shards and AdamW state live in the gang between updates."""
    write_resident_config(path, model)
    text = path.read_text()
    assert "orchestration: {workers: resident}" in text and "max_new_tokens: 48" in text
    path.write_text(text.replace("orchestration: {workers: resident}",
                                 "orchestration: {workers: resident, critic_ranks: 2}\n"
                                 "advantage: {estimator: gae, gae_lambda: 0.9}\n"
                                 "critic: {lr: 1.0e-2, fsdp: {reshard_after_forward: true}}")
                    .replace("name: faults-resident", "name: faults-critic-gang")
                    .replace("max_new_tokens: 48", "max_new_tokens: 16"))
    return path


def write_partial_config(path: Path, model: str, iterations: int = 3) -> Path:
    """``write_async_config``'s run with partial rollouts (issue 48): chunks of 16 of the 48 new
    tokens, so every group (the tiny model never emits EOS) spans three rollouts; iterations 1 and
    2 train on nothing and iteration 3 on the groups iteration 1 started."""
    write_async_config(path, model, iterations)
    path.write_text(path.read_text().replace("name: faults-async", "name: faults-partial").replace(
        "max_staleness: 1}", "max_staleness: 1, partial: {chunk_tokens: 16}}"))
    return path


def _ps() -> list[tuple[int, int, str]]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        pid, ppid, *args = line.split(None, 2)
        rows.append((int(pid), int(ppid), args[0] if args else ""))
    return rows


def _start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22)."""
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[19])


def resident_workers(driver_pid: int) -> list[tuple[int, str]]:
    """(pid, process title) of the live resident workers (Ray actors of ``WORKER_CLASSES``) started
    under the training process ``driver_pid`` (its descendants; Ray gives each worker a session
    of its own, so the process group does not find them), oldest first. The title is
    ``ray::<class>.run`` (e.g. ``ray::RolloutWorker.run``) while ``run`` (a stage program) executes."""
    rows = _ps()
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in rows:
        children.setdefault(ppid, []).append(pid)
    below, todo = set(), [driver_pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in below:
                below.add(c)
                todo.append(c)
    found = []
    for pid, _, title in rows:
        if pid in below and title.startswith(tuple(f"ray::{c.__name__}" for c in WORKER_CLASSES.values())):
            try:
                found.append((_start_ticks(pid), pid, title))
            except (OSError, IndexError, ValueError):  # it just ended
                continue
    return [(pid, title) for _, pid, title in sorted(found)]


class _Output:
    """The lines a subprocess prints, read as they come (a thread), with the time of each."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for raw in proc.stdout:
            self.lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))

    def first(self, text: str) -> float | None:
        """When the first line containing ``text`` came (None: not yet)."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def worker_pid(self, role: str, pool: str) -> int | None:
        """The pid of the latest ``role`` worker (rank 0) of ``pool`` the driver has logged starting
        (rft_core/workers/pool.py's placement line), or None."""
        said = re.compile(rf"resident worker {role} of {re.escape(pool)}: .*\bpid (\d+),")
        found = [m for _, line in list(self.lines) if (m := said.search(line))]
        return int(found[-1].group(1)) if found else None

    def text(self) -> str:
        self._thread.join(10)
        return "\n".join(line for _, line in self.lines)


# the line the CLI prints after its data check, right before the flow (and so iteration 1's
# prompts) starts: the trigger of a kill in the prompts of iteration 1, which waits for no stage
DATA_CHECKED = "data: "


@dataclass
class Timeline:
    """When the stages of an uninterrupted run ran: ``stages[(iteration, stage)] = (start, end)``
    in epoch seconds (end: the manifest's ``created_at``; start: end minus the stage's
    ``seconds`` and ``checkpoint_seconds``); ``data_checked``: when the CLI printed its data check."""

    stages: dict[tuple[int, str], tuple[float, float]]
    data_checked: float

    def seconds(self, iteration: int, stage: str) -> float:
        start, end = self.stages[(iteration, stage)]
        return end - start

    def durations(self, iteration: int = 1) -> dict[str, float]:
        """Each stage's seconds in ``iteration``."""
        return {s: self.seconds(it, s) for it, s in self.stages if it == iteration}


def _waits_for(iteration: int, stage: str, present: dict[tuple[int, str], tuple[float, float]]) -> list[tuple[int, str]]:
    """The (iteration, stage) commits ``stage`` of ``iteration`` waits for, among those in ``present``
    (the uninterrupted run's ``Timeline.stages``): its predecessors of the same iteration, and the
    previous iteration's update where that run started ``stage`` only after the update committed
    (a synchronous run: the rollout samples with the update's policy; the prompts, committed beside
    that update, are no sign that it has ended, so a kill timed from them alone could land in it)."""
    if not PREDECESSORS[stage]:  # the prompts: beside the previous iteration's update (a synchronous run)
        return [(iteration - 1, "advantages")] if iteration > 1 else []
    same = [(iteration, p) for p in PREDECESSORS[stage] if (iteration, p) in present]
    if not same:
        raise AssertionError(f"none of the stages {stage} of iteration {iteration} waits for "
                             f"({PREDECESSORS[stage]}) ran in the uninterrupted run")
    update = (iteration - 1, "ppo_update")
    if stage in STAGE_ORDER and update in present and (iteration, stage) in present and \
            present[update][1] <= present[(iteration, stage)][0]:
        same.append(update)
    return same


def run_scenario(config: Path, run_root: Path | str, target: str, iteration: int, timeline: Timeline,
                 baseline: torch.Tensor, api_url: str | None, rng: random.Random, timeout: float = 300,
                 phase: str = "compute", env: dict[str, str] | None = None, kill: str = "driver",
                 final_iteration: int = 2, also: tuple[str, int] | None = None, attempts: int = 3,
                 after_line: str | None = None) -> Outcome:
    """Kill the training inside ``target`` of ``iteration``, rerun, check (``Outcome`` says what).

    ``kill="driver"``: SIGKILL the training process's group (the flow and its local Ray) and its
    resident workers (sessions of their own: killed by pid at the same moment). ``kill="worker"``:
    SIGKILL only the resident worker of ``target``'s role (``ROLE_OF_STAGE``), and only while it
    runs a stage program (waiting up to ``WORKER_WAIT_S`` for one); the run
    replaces it and goes on, and is then rerun like the others (which reuses every committed
    stage). ``final_iteration``: the run's last iteration (its weights are compared with
    ``baseline``). ``also``: (stage, iteration) that must be running too at the kill (an overlap
    row of ``rollout.max_staleness`` >= 1); the kill then waits for the predecessors of both and
    lands inside the stretch where both ran in the uninterrupted run. ``after_line``: the kill
    also waits until the driver has printed a line containing it (a stage's own log line, e.g.
    where it starts generating), then a random part (up to 30%) of the stage's duration in the
    uninterrupted run; ``Outcome.line_at`` says when it came (a row that must land inside that
    part of the stage asserts it is before ``kill_time``).

    ``phase="compute"``: once the stage can start (its predecessors committed), wait as long as
    it waited to start in the uninterrupted run (``timeline``, the same iteration) plus a random
    part (up to 85%) of its duration there. ``phase="write"``: within 20 ms after the stage took
    its writer lock, i.e. while it writes its parts or checkpoint files (a Parquet stage,
    ``PAUSED_WRITES``, with its writer paused between its parts and its manifest; the kill must
    leave the lock behind). ``run_root`` may be an
    ``s3://`` URI (``env``: the server's endpoint and credentials). A kill that would miss (the
    stage committed first, no worker running it) is not sent: the row starts again in a fresh
    run root with a third of the delay, up to ``attempts`` times.
    """
    scale, out, missed = 1.0, None, []
    for attempt in range(1, attempts + 1):
        root = str(run_root).rstrip("/") + ("" if attempt == 1 else f"-retry{attempt}")
        out = _kill_once(config, root, target, iteration, timeline, api_url, rng, timeout, phase, env, kill, also, scale,
                         after_line)
        out.attempts, out.run_root, out.kill, out.also = attempt, root, kill, also
        out.missed, missed = missed, missed + out.notes
        if out.landed:
            break
        scale /= 3
    assert out is not None
    if not out.landed:
        return out
    _rerun_and_check(config, root, out, baseline, api_url, timeout, env, final_iteration, also)
    print(f"fault row {target} {iteration} {phase} {kill}: tries {out.attempts}, kill after {out.delay} s, "
          f"interrupted {out.interrupted!r}, overlap {out.overlap_live}, redone {out.redone}"
          + (f"; missed before: {out.missed}" if out.missed else ""), flush=True)
    return out


def _kill_once(config, root: str, target: str, iteration: int, timeline: Timeline, api_url, rng, timeout, phase, env,
               kill: str, also, scale: float, after_line: str | None = None) -> Outcome:
    """One try of ``run_scenario``'s kill; ``out.landed`` says whether it landed where it should."""
    pending = [(iteration, target)] + ([(also[1], also[0])] if also else [])
    waits = sorted({w for it, s in pending for w in _waits_for(it, s, timeline.stages)})
    lock = f"{root}/iter={iteration:06d}/{target}/.writer.lock"
    if phase == "write":
        triggers = [lock]
        delay = rng.uniform(0.0, 0.02) * scale
    else:
        triggers = [f"{root}/iter={it:06d}/{s}/_MANIFEST.json" for it, s in waits]
        t_trig = max((timeline.stages[w][1] for w in waits), default=timeline.data_checked)
        starts = [timeline.stages[p][0] for p in pending]
        ends = [timeline.stages[p][1] for p in pending]
        lo, hi = max(starts), min(ends)
        if hi <= lo:
            raise AssertionError(f"{pending}: these stages did not run side by side in the uninterrupted run "
                                 f"({dict((p, timeline.stages[p]) for p in pending)}): no overlap to kill in")
        delay = (max(lo - t_trig, 0.0) + rng.uniform(0.0, 0.85) * (hi - lo)) * scale
    poll = 0.002 if "://" not in root else 0.02
    paused = phase == "write" and target in PAUSED_WRITES
    proc = start_training(config, root, api_url, env,
                          write_pause=f"iter={iteration:06d}/{target}@{WRITE_PAUSE_SECONDS}" if paused else None)
    output = _Output(proc)
    # A driver kill takes the resident workers too: Ray gives each a session of its own, so the
    # process group misses them and they would die only later, when their raylet notices (a
    # background checkpoint write could still commit). Their pids are looked up while waiting
    # (``ps`` takes tens of ms: not between the trigger and the kill) and killed with the group.
    resident = kill == "driver" and load_config(str(config)).orchestration.workers == "resident"
    workers, listed = [], 0.0
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        if all(exists(t) for t in triggers) and (triggers or output.first(DATA_CHECKED) is not None):
            break
        if resident and time.time() - listed > 0.5:
            workers, listed = [pid for pid, _ in resident_workers(proc.pid)], time.time()
        time.sleep(poll)
    if after_line is not None:  # then the stage's own line, and a random part of its duration after it
        while (proc.poll() is None and output.first(after_line) is None and time.time() - t0 < timeout
               and not any(exists(f"{root}/iter={p[0]:06d}/{p[1]}/_MANIFEST.json") for p in pending)):
            time.sleep(poll)
        stage = timeline.stages[(iteration, target)]
        delay = rng.uniform(0.0, 0.3) * (stage[1] - stage[0]) * scale
    time.sleep(delay)
    out = Outcome(target=target, iteration=iteration, phase=phase, delay=round(delay, 3), killed=False,
                  write_paused=paused)
    # before the kill, only the pending stages' manifests are looked at (a listing of the run takes ms)
    done = None if proc.poll() is not None else [
        p for p in pending if exists(f"{root}/iter={p[0]:06d}/{p[1]}/_MANIFEST.json")]
    if done is None or done:
        out.notes.append(f"attempt at {root}: no kill sent, " + ("the run had ended" if done is None else
                         f"{done} committed within {delay:.3f} s"))
        _end(proc)
        return out
    victim = None
    if kill == "worker":
        role = ROLE_OF_STAGE[target]
        # the worker may be between calls (a weight sync, a ping): wait up to WORKER_WAIT_S for it
        # to run a stage program, as long as the target has not committed, rather than start again
        deadline = time.time() + WORKER_WAIT_S
        while True:
            workers = resident_workers(proc.pid)
            pid = output.worker_pid(role, root)
            if pid is not None and dict(workers).get(pid, "").startswith(f"ray::{WORKER_CLASSES[role].__name__}.run"):
                victim = pid
                break
            if time.time() > deadline or proc.poll() is not None or any(
                    exists(f"{root}/iter={p[0]:06d}/{p[1]}/_MANIFEST.json") for p in pending):
                out.notes.append(f"attempt at {root}: no kill sent, the {role} worker (pid {pid}) was not running a "
                                 f"stage within {WORKER_WAIT_S} s (workers, oldest first: {workers})")
                _end(proc)
                return out
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    out.kill_time, out.killed = time.time(), True
    out.line_at = None if after_line is None else output.first(after_line)
    out.committed_at_kill = committed(root)
    _interrupted(root, target, iteration, out)
    out.overlap_live = None if also is None else not any(p in out.committed_at_kill for p in pending)
    out.landed = (not any(p in out.committed_at_kill for p in pending)
                  and all(w in out.committed_at_kill for w in waits))
    if phase == "write" and not exists(lock):  # a writer killed while writing leaves its lock
        out.landed = False
        out.notes.append(f"attempt at {root}: no writer lock {lock} after the kill: the stage was not writing")
    if kill == "worker":
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
        log = output.text()
        # rft_core/workers/pool.py's warning: "the <role> worker (<rank and node>) died during <program> (...)"
        said = rf"the {ROLE_OF_STAGE[target]} worker(?: \(.*\))? died during {target} "
        if not re.search(said, log):
            out.landed = False
            out.notes.append(f"the driver's log does not say {said!r}: " + log[-2000:])
        if proc.returncode != 0:
            out.notes.append("the run did not survive the worker kill: " + log[-2000:])
    if not out.landed:
        out.notes.append(f"attempt at {root}: the kill missed {pending}; committed then: {sorted(out.committed_at_kill)}")
    return out


def _end(proc: subprocess.Popen) -> None:
    """Stop an attempt's training for good (its process group; its Ray workers end with their Ray)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _rerun_and_check(config, root: str, out: Outcome, baseline, api_url, timeout, env, final_iteration: int, also) -> None:
    import datetime as dt

    from schemas import read_manifest, read_shard

    before = snapshot(root)
    out.committed_before = len({"/".join(k.split("/")[:2]) for k in before})
    out.rerun_started = time.time()
    rerun = start_training(config, root, api_url, env)
    log, _ = rerun.communicate(timeout=timeout)
    out.rerun_ok = rerun.returncode == 0
    out.rerun_log = log.decode(errors="replace")[-50_000:]
    if not out.rerun_ok:
        out.notes.append(log.decode(errors="replace")[-2000:])
        return
    changed = untouched(before, snapshot(root), root)
    out.committed_untouched = not changed
    if changed:
        out.notes.append(f"changed: {changed}")
    redone = []
    for it, stage in [(out.iteration, out.target)] + ([(also[1], also[0])] if also else []):
        try:
            m, _ = read_manifest(f"{root}/iter={it:06d}/{stage}")
            redone.append(dt.datetime.fromisoformat(m.created_at).timestamp() > out.kill_time)
        except Exception as exc:  # reported, and the test fails on it
            out.notes.append(f"iteration {it} {stage} not committed after the rerun: {exc}")
            redone.append(False)
    out.redone = all(redone)
    try:
        fs, _ = _fs(root)
        for manifest in fs.glob(f"{root.split('://', 1)[-1]}/iter=*/*/_MANIFEST.json"):
            stage_dir = manifest.rsplit("/", 1)[0]
            read_shard(f"{root.split('://', 1)[0]}://{stage_dir}" if "://" in root else stage_dir)
        out.all_valid = True
    except Exception as exc:  # reported, and the test fails on it
        out.notes.append(f"invalid shard: {exc}")
    out.same_weights = bool(torch.equal(final_weights(root, final_iteration), baseline))


def baseline_run(config: Path, run_root: Path | str, api_url: str | None,
                 env: dict[str, str] | None = None, final_iteration: int = 2,
                 trained: tuple[int, ...] | None = None) -> tuple[torch.Tensor, Timeline]:
    """An uninterrupted run: its final weights and its ``Timeline``. Asserts first that its
    rewards vary and its updates have a policy gradient in every iteration (or in the iterations
    ``trained``: a partial rollout's first iterations train on nothing)
    (``tests.varying.assert_training_signal``): the weights the fault rows compare come from
    real updates."""
    import datetime as dt

    from schemas import read_manifest
    from tests.varying import assert_training_signal

    proc = start_training(config, run_root, api_url, env)
    output = _Output(proc)
    proc.wait(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(output.text()[-3000:])
    assert_training_signal(run_root, trained or range(1, final_iteration + 1))
    stages = {}
    fs, root = _fs(run_root)
    prefix = f"{str(run_root).split('://', 1)[0]}://" if "://" in str(run_root) else ""
    for m in fs.glob(f"{root}/iter=*/*/_MANIFEST.json"):
        man = read_manifest(prefix + m.rsplit("/", 1)[0])[0]
        end = dt.datetime.fromisoformat(man.created_at).timestamp()
        seconds = float(man.summary.get("seconds", 0.0)) + float(man.summary.get("checkpoint_seconds", 0.0))
        it_dir, stage = m.rsplit("/", 3)[-3:-1]
        stages[(int(it_dir.split("=")[1]), stage)] = (end - seconds, end)
    checked = output.first(DATA_CHECKED)
    if checked is None:
        raise RuntimeError(f"the CLI printed no {DATA_CHECKED!r} line: " + output.text()[-2000:])
    return final_weights(run_root, final_iteration), Timeline(stages, checked)


def row(*values, ci: bool = False, group: int | None = None):
    """A ``pytest.mark.parametrize`` row of a SIGKILL test. ``ci=True``: every run runs it; otherwise
    it joins the rotation (``tests/rotation.py``): ``group`` if given (rows that share an expensive
    baseline go together, so fewer groups pay for it), else the next group of its module; a run
    (CI's ``make test``) runs the rows of one group; ``make test-faults-all`` runs every row. The
    group rides on the row as ``pytest.mark.rotation(group)``, which ``tests/conftest.py`` reads."""
    if group is not None and not 0 <= group < GROUPS:
        raise ValueError(f"row group {group} is not one of the rotation's {GROUPS} groups")
    chosen = None if ci else (assign(caller_module()) if group is None else group)
    return pytest.param(*values, marks=(pytest.mark.rotation(chosen),))


def assert_row(out: Outcome) -> None:
    """What every SIGKILL row must show: the kill was sent and landed where the row names it, the
    interrupted work was redone, the rerun resumed with every committed file untouched and every
    shard valid, and the final weights equal the baseline's bit for bit."""
    assert out.killed, f"no kill was sent: {out.notes}"
    assert out.landed, f"the kill did not land in iteration {out.iteration}'s {out.target}: {out.missed + out.notes}"
    assert out.rerun_ok, out.notes
    assert out.redone, f"the interrupted stage was not redone after the kill: {out.notes}"
    assert out.committed_untouched, f"a committed stage was rewritten: {out.notes}"
    assert out.all_valid, out.notes
    assert out.same_weights, "the resumed run's final weights differ from the uninterrupted run's"


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


@dataclass
class Baseline:
    """The uninterrupted run of one scenario that each of its SIGKILL rows is compared with: built
    once per scenario (a module-scoped fixture of its test module, or once per part of
    ``benchmarks/reliability.py``) and shared by every row. ``weights``: the final weights each
    resumed run must equal (for the resident scenario, stage mode's)."""

    config: Path
    weights: torch.Tensor
    timeline: Timeline
    api_url: str | None
    runs: str  # where the rows' run roots go: a local folder or an s3:// prefix
    final_iteration: int = 2
    env: dict[str, str] | None = None  # the run's environment (an S3 server's endpoint and credentials)
    salt: str = ""  # put before each row's seed (benchmarks/reliability.py --seed, --repeats); "": the tests' seeds

    def kill(self, name: str, target: str, iteration: int, seed: str, **kw) -> Outcome:
        """``run_scenario`` of this scenario in the run root ``runs/name``, with ``random.Random(salt + seed)``."""
        return run_scenario(self.config, f"{self.runs.rstrip('/')}/{name}", target, iteration, self.timeline, self.weights,
                            self.api_url, random.Random(self.salt + seed), env=self.env,
                            final_iteration=self.final_iteration, **kw)


def scenario_baseline(d: Path, write, model: str, api_url: str | None) -> Baseline:
    """``Baseline`` of the config ``write(path, model)`` writes (``baseline_run`` asserts that its
    rewards vary and its updates have a policy gradient)."""
    config = write(d / "config.yaml", model)
    weights, timeline = baseline_run(config, d / "baseline", api_url)
    return Baseline(config, weights, timeline, api_url, str(d))


def resident_baseline(d: Path, model: str, api_url: str | None) -> Baseline:
    """The resident scenario (``write_resident_config``): the weights are STAGE MODE's (every stage
    loads its model, a checkpoint every iteration), the timeline the resident run's, and the
    uninterrupted resident run is asserted to end with stage mode's weights bit for bit."""
    stage, _ = baseline_run(write_resident_config(d / "stage.yaml", model, stage=True), d / "stage", api_url,
                            final_iteration=3)
    config = write_resident_config(d / "resident.yaml", model)
    resident, timeline = baseline_run(config, d / "baseline", api_url, final_iteration=3)
    assert torch.equal(resident, stage), "the uninterrupted resident run differs from stage mode"
    return Baseline(config, stage, timeline, api_url, str(d), final_iteration=3)


# The rows themselves, one function per kind, run by their test (which adds the asserts) and by
# benchmarks/reliability.py (which tabulates the outcome): the same run roots, seeds and kills.

def stage_row(b: Baseline, target: str, iteration: int, phase: str) -> Outcome:
    """tests/test_faults.py: kill the driver in ``target`` of ``iteration``, phase compute or write."""
    return b.kill(f"run-{target}-{iteration}-{phase}", target, iteration, f"{target}-{iteration}-{phase}", phase=phase)


def stage_checkpoint_row(b: Baseline) -> Outcome:
    """tests/test_faults.py: the stage-mode scenario (``checkpoint.async_weights`` by default: its
    updates commit the weights' digest and the writer thread writes the weights), the driver killed
    while the writer writes iteration 1's weights (``ppo_update-policy``: its writer lock taken,
    the optimizer stage before it committed, no manifest yet)."""
    return b.kill("run-stage-checkpoint-write", "ppo_update-policy", 1, "stage-checkpoint-write", phase="write")


def stage_every_row(b: Baseline) -> Outcome:
    """tests/test_faults.py: the stage-mode scenario with ``checkpoint.every: 2`` (iteration 1's
    policy lives in the driver's memory only: its update commits the weights' digest and its input,
    no weights, no optimizer stage), the driver killed in iteration 2's rollout; the rerun rebuilds
    policy 1 (the initial model and update 1 re-applied) and must end with the scenario's weights,
    which the run that wrote every checkpoint made."""
    config = b.config.with_name(f"{b.config.stem}-every-2.yaml")
    config.write_text(b.config.read_text() + "checkpoint: {every: 2}\n")
    return replace(b, config=config).kill("run-stage-every-2", "rollout", 2, "stage-every-2-rollout-2")


def agent_row(b: Baseline, iteration: int) -> Outcome:
    """tests/test_faults.py: kill the driver inside the multi-turn rollout of ``iteration``."""
    return b.kill(f"run-rollout-{iteration}", "rollout", iteration, f"agent-rollout-{iteration}")


def resident_row(b: Baseline, target: str, kill: str) -> Outcome:
    """tests/test_faults_resident.py: kill the driver, or ``target``'s resident worker, in
    ``target`` of iteration 2."""
    return b.kill(f"run-{target}-{kill}", target, 2, f"resident-{target}-{kill}", kill=kill)


def resident_checkpoint_row(b: Baseline) -> Outcome:
    """tests/test_faults_resident.py: kill the driver (the workers with it) while the policy worker
    writes iteration 3's checkpoint in the background (``ppo_update-policy``: its writer lock
    taken, the optimizer stage committed before it, no manifest yet)."""
    return b.kill("run-checkpoint-write", "ppo_update-policy", 3, "resident-checkpoint-write", phase="write")


def fsdp_baseline(d: Path, model: str, api_url: str | None) -> Baseline:
    """The resident FSDP2 scenario (``write_fsdp_config``): 3 iterations, the weights the
    uninterrupted FSDP2 run's."""
    config = write_fsdp_config(d / "fsdp.yaml", model)
    weights, timeline = baseline_run(config, d / "baseline", api_url, final_iteration=3)
    return Baseline(config, weights, timeline, api_url, str(d), final_iteration=3)


def fsdp_row(b: Baseline, target: str, kill: str) -> Outcome:
    """tests/test_faults_fsdp.py: kill the driver, or the policy worker's rank 0, in ``target`` of
    iteration 2 (15 min allowed: two ranks rebuilt per rerun)."""
    return b.kill(f"run-{target}-{kill}", target, 2, f"fsdp-{target}-{kill}", kill=kill, timeout=900)


def critic_gang_baseline(d: Path, model: str, api_url: str | None) -> Baseline:
    """The resident critic gang scenario (``write_critic_gang_config``): 3 iterations, the weights the
    uninterrupted run's (iteration 3's advantages come from the critic that update 2 trained)."""
    config = write_critic_gang_config(d / "critic-gang.yaml", model)
    weights, timeline = baseline_run(config, d / "baseline", api_url, final_iteration=3)
    return Baseline(config, weights, timeline, api_url, str(d), final_iteration=3)


def critic_gang_row(b: Baseline) -> Outcome:
    """tests/test_faults_critic.py: kill the critic gang's rank 0 in iteration 2's ``critic_update``
    (15 min allowed: a new gang of two ranks, as ``fsdp_row``)."""
    return b.kill("run-critic_update-worker", "critic_update", 2, "critic-gang-worker", kill="worker", timeout=900)


def partial_baseline(d: Path, model: str, api_url: str | None) -> Baseline:
    """The partial-rollout scenario (``write_partial_config``): 3 iterations, only the third trains."""
    config = write_partial_config(d / "partial.yaml", model)
    weights, timeline = baseline_run(config, d / "baseline", api_url, final_iteration=3, trained=(3,))
    return Baseline(config, weights, timeline, api_url, str(d), final_iteration=3)


def partial_row(b: Baseline) -> Outcome:
    """tests/test_faults_async.py: kill the driver in iteration 2's rollout, while it continues the
    sequences iteration 1 carried (mid-chunk): after the rollout logged that it starts generating
    (``CONTINUING_LINE``), within 30% of its duration in the uninterrupted run."""
    return b.kill("run-rollout-2", "rollout", 2, "partial-rollout-2", after_line=CONTINUING_LINE)


def async_row(b: Baseline, target: str, iteration: int, other: tuple[str, int]) -> Outcome:
    """tests/test_faults_async.py: kill the driver while ``target`` of ``iteration`` and ``other``
    run side by side."""
    return b.kill(f"run-{target}-{iteration}", target, iteration, f"async-{target}-{iteration}", also=other)


def s3_row(b: Baseline, target: str, phase: str) -> Outcome:
    """tests/test_object_storage.py: kill the driver in ``target`` of iteration 1 with the run root
    in the S3 bucket (``b.runs``: ``s3://...``)."""
    return b.kill(f"kill-{target}-{phase}", target, 1, f"s3-{target}", phase=phase)
