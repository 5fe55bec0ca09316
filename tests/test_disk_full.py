"""The disk fills up mid-run: ``run_root`` on a small tmpfs mounted here; once iteration 2 has
started (its prompts committed), the rest of the disk is taken by another file, so the next
stage fails with ENOSPC while writing. The error names the stage, the run and the cause; the
failed stage has no manifest; iteration 1's checkpoint is intact (every file verifies, none
changed); after the space is freed the same command resumes and finishes.

Skipped where a tmpfs cannot be mounted (not root, or no mount rights in the container).
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults import snapshot, start_training, write_config

pytestmark = pytest.mark.timeout(600)
ITERATION_STAGES = ("prompts", "rollout", "rewards", "actor_logprobs", "ref_logprobs", "advantages", "ppo_update")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 300, *, gone: tuple[Path, ...] = ()) -> None:
    """Until every one of ``paths`` exists and none of ``gone`` does."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths) or any(p.exists() for p in gone):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run ended (or timed out) before {paths} existed and {gone} were gone:\n"
                                 f"{proc.communicate()[0].decode(errors='replace')[-3000:]}")
        time.sleep(0.002)


def _fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file (preallocated: ``posix_fallocate``)."""
    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for _ in range(5):  # the free space may shrink meanwhile (the run writes): retry with what is left
            st = os.statvfs(disk)
            if st.f_bavail == 0:
                break
            try:
                os.posix_fallocate(fd, os.fstat(fd).st_size, st.f_bavail * st.f_frsize)
            except OSError:
                continue
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0
    return ballast


@pytest.mark.rotation(2)  # long: one turn in 8 (tests/rotation.py)
def test_enospc_mid_run_names_the_stage_keeps_the_checkpoint_and_resumes(prefect_harness, tiny_model, small_disk, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from schemas import ShardRef, read_shard, verify_files
    from rft_core.stages.lineage import weights_stage

    api = PREFECT_API_URL.value()
    config = write_config(tmp_path / "run.yaml", tiny_model)
    run = small_disk / "run"
    proc = start_training(config, run, api)
    it1, it2 = run / "iter=000001", run / "iter=000002"
    # iteration 1's whole checkpoint: its weights and optimizer state are written in the background
    # (ppo_update-policy, ppo_update-optimizer), so either may commit after iteration 2's prompts
    # (committed: the manifest written, then the writer lock released)
    background = [it1 / "ppo_update-policy", it1 / "ppo_update-optimizer"]
    _wait_for([b / "_MANIFEST.json" for b in background] + [it2 / "prompts" / "_MANIFEST.json"], proc,
              gone=tuple(b / ".writer.lock" for b in background))
    ballast = _fill(small_disk)  # another process takes the rest of the disk while iteration 2 runs
    committed = {s for s in ITERATION_STAGES if (it2 / s / "_MANIFEST.json").exists()}  # before the disk was full
    before = {k: v for k, v in snapshot(run).items() if k.startswith("iter=000001/")}
    log = proc.communicate(timeout=300)[0].decode(errors="replace")
    assert proc.returncode != 0, log[-3000:]
    m = re.search(rf"writing stage iter=2/(\S+) of run {re.escape(str(run))} failed at (\S+): No space left on device "
                  r"\[errno 28: ENOSPC\] \(0 B free of 64.0 MiB on that filesystem\)\. Nothing of this stage was committed",
                  log)
    assert m, log[-4000:]
    failed = m.group(1)
    assert m.group(2).startswith(f"{it2 / failed}/")  # the file it was writing
    assert failed in set(ITERATION_STAGES) - committed, (failed, committed)  # one after the fill (not the prompts)
    assert not (it2 / failed / "_MANIFEST.json").exists()  # no manifest for the partial stage
    # iteration 1's checkpoint (and every committed file) is intact
    after = {k: v for k, v in snapshot(run).items() if k.startswith("iter=000001/")}
    assert after == before
    held = weights_stage(ShardRef.from_manifest(str(it1 / "ppo_update")))  # written in the background: ppo_update-policy
    assert held is not None and "policy/model.safetensors" in verify_files(held.uri)
    for stage in ("prompts", "rollout", "rewards", "advantages"):
        read_shard(str(it1 / stage))

    ballast.unlink()  # space freed: the same command resumes
    rerun = start_training(config, run, api)
    log2 = rerun.communicate(timeout=300)[0].decode(errors="replace")
    assert rerun.returncode == 0, log2[-3000:]
    assert (it2 / failed / "_MANIFEST.json").exists() and (it2 / "ppo_update" / "_MANIFEST.json").exists()
    assert all(snapshot(run).get(k) == v for k, v in before.items()
               if not k.startswith("iter=000001/ppo_update-optimizer/"))  # pruned by retention after iteration 2
