"""Fault injection: SIGKILL a training worker (a real subprocess) at a random point inside a
stage, rerun the same training, and check what survived. Used by tests/test_faults.py and
benchmarks/reliability.py (which writes docs/reliability.md)."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGE_ORDER = ["prompts", "rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update"]
# the stage whose commit means `stage` can start (actor/ref/rewards start together after the rollout)
PREVIOUS = {"prompts": None, "rollout": "prompts", "actor_logprobs": "rollout", "ref_logprobs": "rollout",
            "rewards": "rollout", "advantages": "rewards", "ppo_update": "advantages",
            # the policy's AdamW state, written in the background after ppo_update commits
            "ppo_update-optimizer": "ppo_update"}


def write_config(path: Path, model: str) -> Path:
    """A tiny 2-iteration training config whose stages take a noticeable time."""
    path.write_text(f"""
name: faults
iterations: 2
policy: {{path: {model}}}
data: {{prompts_per_iteration: 4, size: 50}}
rollout: {{n_samples_per_prompt: 4, max_new_tokens: 48, batch_size: 8}}
kl: {{kl_coef: 0.05}}
update: {{lr: 1.0e-3, micro_batch_size: 2, epochs: 2}}
""")
    return path


def _env(api_url: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def start_training(config: Path, run_root: Path, api_url: str | None) -> subprocess.Popen:
    """The worker: the CLI, in its own process group (so the kill takes all its threads)."""
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "-c", str(config), "--run-root", str(run_root)],
                            cwd=ROOT, env=_env(api_url), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def snapshot(run_root: Path) -> dict[str, tuple[int, str]]:
    """(mtime_ns, sha256) of every file under the committed stages of the run."""
    out = {}
    for manifest in run_root.glob("iter=*/*/_MANIFEST.json"):
        for p in manifest.parent.rglob("*"):
            if p.is_file():
                out[str(p.relative_to(run_root))] = (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def final_weights(run_root: Path) -> torch.Tensor:
    from rft_core.models.loading import load_causal_lm

    model = load_causal_lm(str(run_root / "iter=000002/ppo_update/policy"))
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


def run_scenario(config: Path, run_root: Path, target: str, iteration: int, durations: dict[str, float],
                 baseline: torch.Tensor, api_url: str | None, rng: random.Random, timeout: float = 300,
                 phase: str = "compute") -> Outcome:
    """Kill the worker inside ``target`` of ``iteration``, rerun, check.

    ``phase="compute"``: a random time after the stage can start (the stage before it committed),
    within 1.2x its measured duration. ``phase="write"``: within 20 ms after the stage took its
    writer lock, i.e. while it writes its parts or checkpoint files.
    """
    from schemas import read_shard

    it_dir = run_root / f"iter={iteration:06d}"
    prev = PREVIOUS[target]
    if phase == "write":
        trigger, delay = it_dir / target / ".writer.lock", rng.uniform(0.0, 0.02)
    else:
        trigger = (it_dir / prev / "_MANIFEST.json") if prev else (
            run_root / f"iter={iteration - 1:06d}" / "ppo_update" / "_MANIFEST.json" if iteration > 1 else None)
        delay = rng.uniform(0.0, 1.2 * max(durations.get(target, 0.5), 0.2))
    proc = start_training(config, run_root, api_url)
    t0 = time.time()
    while trigger is not None and time.time() - t0 < timeout and proc.poll() is None and not trigger.exists():
        time.sleep(0.002)
    time.sleep(delay)
    out = Outcome(target=target, iteration=iteration, phase=phase, delay=round(delay, 3), killed=proc.poll() is None)
    if out.killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for it in (1, 2):
        d = run_root / f"iter={it:06d}"
        if target not in STAGE_ORDER and it == iteration and not (d / target / "_MANIFEST.json").exists():
            out.interrupted = f"{it}: {target}"  # a stage outside the main order (the background optimizer write)
            out.partial_files = (d / target).exists() and any((d / target).iterdir())
            break
        committed = {p.parent.name for p in d.glob("*/_MANIFEST.json")} if d.exists() else set()
        pending = [s for s in STAGE_ORDER if s not in committed]
        if pending:
            out.interrupted = f"{it}: " + " + ".join(s for s in pending if s not in committed and (d / s).exists()) \
                if any((d / s).exists() for s in pending) else f"{it}: {pending[0]} (computing, no files yet)"
            out.partial_files = any((d / s).exists() and any((d / s).iterdir()) for s in pending)
            break
    else:
        out.interrupted = "(none: the run had finished)"
    before = snapshot(run_root)
    out.committed_before = len({"/".join(k.split("/")[:2]) for k in before})
    rerun = start_training(config, run_root, api_url)
    log, _ = rerun.communicate(timeout=timeout)
    out.rerun_ok = rerun.returncode == 0
    if not out.rerun_ok:
        out.notes.append(log.decode(errors="replace")[-2000:])
        return out
    after = snapshot(run_root)
    out.committed_untouched = all(after.get(k) == v for k, v in before.items())
    try:
        for manifest in run_root.glob("iter=*/*/_MANIFEST.json"):
            read_shard(str(manifest.parent))
        out.all_valid = True
    except Exception as exc:  # reported, and the test fails on it
        out.notes.append(f"invalid shard: {exc}")
    out.same_weights = bool(torch.equal(final_weights(run_root), baseline))
    return out


def baseline_run(config: Path, run_root: Path, api_url: str | None) -> tuple[torch.Tensor, dict[str, float]]:
    """An uninterrupted run: its final weights and each stage's seconds in iteration 1."""
    import json

    proc = start_training(config, run_root, api_url)
    log, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(log.decode(errors="replace")[-3000:])
    durations = {}
    for m in (run_root / "iter=000001").glob("*/_MANIFEST.json"):
        s = json.loads(m.read_text())["summary"]
        durations[m.parent.name] = float(s.get("seconds", 0.0)) + float(s.get("checkpoint_seconds", 0.0))
    return final_weights(run_root), durations
