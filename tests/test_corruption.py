"""A committed file corrupted on disk (one flipped bit, same size and mtime: bit rot) is found
when the run resumes and needs it: iteration 1's ``policy/model.safetensors`` stops iteration 2
with an error naming the file and the repair command; ``rft verify`` lists it; ``repair`` moves exactly that stage and what depends on it aside; the same training
command then recomputes them (the same weights, bit for bit, on CPU) and reuses everything else
untouched. A corrupted Parquet part is refused when its stage is reused."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import ROOT, snapshot, start_training, write_config
from tests.varying import assert_training_signal

pytestmark = pytest.mark.timeout(600)


def _flip(path: Path, offset: int) -> None:
    """Flip one bit of ``path`` in place, keeping its size and modification time."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rft(*args: str) -> subprocess.CompletedProcess:
    """``rft ARGS`` (the console script's ``flows.cli:main``)."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _train(config: Path, run: Path, api: str) -> tuple[int, str]:
    proc = start_training(config, run, api)
    out = proc.communicate(timeout=300)[0]
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.rotation(0)  # long: one turn in 8 (tests/rotation.py)
def test_corrupted_checkpoint_found_on_resume_and_repaired(prefect_harness, tiny_model, tmp_path):
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    run = tmp_path / "run"
    rc, log = _train(write_config(tmp_path / "one.yaml", tiny_model, iterations=1), run, api)
    assert rc == 0, log[-3000:]
    assert_training_signal(run, (1,))  # the update recomputed below is a real policy-gradient step (tests/varying.py)
    # stage mode writes the weights in the background (checkpoint.async_weights): a stage of their own
    weights = run / "iter=000001/ppo_update-policy/policy/model.safetensors"
    good = hashlib.sha256(weights.read_bytes()).hexdigest()
    _flip(weights, weights.stat().st_size // 2)

    two = write_config(tmp_path / "two.yaml", tiny_model, iterations=2)
    rc, log = _train(two, run, api)  # resume into iteration 2, which starts from iteration 1's weights
    assert rc != 0
    assert f"{weights}: checksum does not match the manifest: the committed file is corrupted" in log, log[-4000:]
    assert f"rft repair {run} --stage iter=1/ppo_update-policy" in log
    assert not (run / "iter=000002/rollout/_MANIFEST.json").exists()  # nothing was trained on the damaged weights

    res = _rft("verify", str(run))
    assert res.returncode == 1 and "CORRUPT iter=1/ppo_update-policy:" in res.stdout and "1 corrupt stage(s)" in res.stdout
    res = _rft("repair", str(run), "--stage", "iter=1/ppo_update-policy", "--dry-run")
    assert res.returncode == 0, res.stderr
    moves = [line.split(": ", 1)[1].split(" (")[0] for line in res.stdout.splitlines() if "would move:" in line]
    # only the weights' stage: the update (its digest) and its optimizer stage are intact, and what
    # started from these weights read them before they were damaged (the rerun writes the same bytes)
    assert moves == ["iter=1/ppo_update-policy"]
    assert (run / "iter=000001/ppo_update-policy/_MANIFEST.json").exists()  # a dry run moves nothing

    before = snapshot(run)
    res = _rft("repair", str(run), "--stage", "iter=1/ppo_update-policy")
    assert res.returncode == 0, res.stderr
    aside = sorted((run / "_repaired").iterdir())
    assert len(aside) == 1 and (aside[0] / "iter=000001/ppo_update-policy/policy/model.safetensors").exists()
    record = json.loads((aside[0] / "_REPAIR.json").read_text())
    assert record["stage"] == "iter=1/ppo_update-policy" and "model.safetensors: checksum does not match" in record["problem"]

    rc, log = _train(two, run, api)  # the same command recomputes the moved stage (the update again) and goes on
    assert rc == 0, log[-3000:]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == good  # recomputed exactly
    after = snapshot(run)
    # iteration 1's optimizer stage: pruned by retention once iteration 2 committed (checkpoint.keep_last=1)
    kept = {k: v for k, v in before.items()
            if not k.startswith(("iter=000001/ppo_update-policy/", "iter=000001/ppo_update-optimizer/"))}
    assert any(k.startswith("iter=000001/ppo_update/") for k in kept)  # the update itself was not recommitted
    assert kept and all(after.get(k) == v for k, v in kept.items())  # every other committed file untouched
    assert any(k.startswith("iter=000001/rollout/") for k in kept) and any(k.startswith("iter=000002/prompts/") for k in kept)
    assert _rft("verify", str(run)).returncode == 0

    # a flipped bit in a committed Parquet part: refused when the stage is reused, with the repair command
    from rft_core.storage import plan_repair
    from schemas import ShardCorruptError, committed_ref, read_manifest

    part = run / "iter=000001/rollout/part-00000.parquet"
    _flip(part, 100)
    m, _ = read_manifest(str(part.parent))
    with pytest.raises(ShardCorruptError, match=rf"{part}: checksum does not match the manifest .* repair {run} --stage "
                                                r"iter=1/rollout"):
        committed_ref(str(part.parent), stage="rollout", config_hash=m.config_hash, contract=m.contract)
    plan = plan_repair(str(run), "iter=1/rollout")
    assert "checksum does not match" in plan.problem
    downstream = ["rollout", "actor_logprobs", "ref_logprobs", "rewards", "advantages", "ppo_update", "ppo_update-optimizer",
                  "ppo_update-policy"]
    assert set(plan.moves) == {f"iter={i}/{s}" for i in (1, 2) for s in downstream}  # not the prompts of either
    assert plan.moves["iter=1/advantages"].startswith("reads ") and \
        plan.moves["iter=2/rollout"] == "reads iter=1/ppo_update"  # its inputs name the policy it samples with
