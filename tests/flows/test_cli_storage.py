"""``rft check``, ``rft verify`` and ``rft repair``: the run root's storage commands (the logic is
``rft_core.storage``; the one command line is ``flows/cli.py``), on a small run of two committed
stages, one reading the other."""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
from typer.testing import CliRunner

from flows.cli import app
from schemas import commit_files, stage_uri, write_shard
from schemas.columns import ACTOR_LOGPROBS

runner = CliRunner()
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def _rft(*args: str):
    out = runner.invoke(app, list(args), env=ENV)
    return out.exit_code, re.sub(r"\x1b\[[0-9;]*m", "", out.output)


def _run(root: Path) -> Path:
    """iter=1/actor_logprobs (a Parquet part) and iter=1/ref_logprobs, which lists it as an input."""
    table = pa.table({"sample_id": ["s0", "s1"], "old_logprobs": [[-0.5], [-0.5, -0.25]],
                      "action_entropy": [[1.5], [1.5, 1.0]]}, schema=ACTOR_LOGPROBS.arrow)
    a = write_shard(table, stage_uri(str(root), 1, "actor_logprobs"), schema=ACTOR_LOGPROBS, config_hash="a")
    b = Path(stage_uri(str(root), 1, "ref_logprobs"))
    b.mkdir(parents=True)
    (b / "notes.txt").write_text("derived from actor_logprobs")
    commit_files(str(b), stage="ref_logprobs", config_hash="b", files=["notes.txt"], inputs={"actor_logprobs": a})
    return Path(a.uri) / "part-00000.parquet"


def test_check_says_what_it_checked_and_names_the_cause(tmp_path):
    code, out = _rft("check", str(tmp_path / "new-run"))
    assert code == 0 and str(tmp_path / "new-run") in out and (tmp_path / "new-run").is_dir()
    (tmp_path / "a-file").write_text("x")
    code, out = _rft("check", str(tmp_path / "a-file" / "run"))
    assert code == 1 and "error: run_root" in out and "No stage was started" in out


def test_verify_lists_a_corrupt_stage_and_repair_moves_it_and_its_dependents(tmp_path):
    root = tmp_path / "run"
    part = _run(root)
    assert _rft("verify", str(root)) == (0, "every committed file matches its manifest\n")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))

    code, out = _rft("verify", str(root))
    assert code == 1 and "CORRUPT iter=1/actor_logprobs:" in out and "checksum does not match" in out
    assert f"repair: rft repair {root} --stage iter=1/actor_logprobs" in out and "1 corrupt stage(s)" in out

    code, out = _rft("repair", str(root), "--stage", "iter=1/actor_logprobs", "--dry-run")
    assert code == 0 and "would move: iter=1/actor_logprobs (asked for)" in out
    assert "would move: iter=1/ref_logprobs (reads iter=1/actor_logprobs)" in out and part.exists()

    code, out = _rft("repair", str(root), "--stage", "iter=1/ref_logprobs")
    assert code == 2 and "nothing to repair" in out  # its files verify: refused without --force

    code, out = _rft("repair", str(root), "--stage", "iter=1/actor_logprobs")
    assert code == 0 and "moved: iter=1/ref_logprobs" in out and f"--run-root {root}" in out
    assert not part.exists() and len(list((root / "_repaired").iterdir())) == 1
    assert _rft("verify", str(root))[0] == 0
    assert _rft("repair", str(root), "--stage", "iter=9/rollout")[0] == 2
    assert _rft("verify", str(tmp_path / "missing"))[0] == 2
