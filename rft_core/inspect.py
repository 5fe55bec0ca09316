"""Look inside a run folder: stage status, joined sample views, exports. No Prefect needed."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from rft_core.stages.lineage import WEIGHTS_DIGEST_KEY, weights_stage
from rft_core.stages.optimizer_state import optimizer_commit
from rft_core.stages.retention import WEIGHT_SUFFIXES
from schemas import ShardError, ShardRef, filesystem, pruned_files, read_manifest, read_shard, stage_uri
from schemas.storage import stage_folders
from schemas.experience import align_on_sample_id
from schemas.shards import MANIFEST_NAME



def run_status(run_root: str) -> list[dict[str, Any]]:
    """One row per (iteration, stage folder): status, rows, bytes, seconds, config hash, and
    for a ``ppo_update`` what it holds of the policy (``checkpoint``: ``_checkpoint_kind``).

    status: ``committed`` (manifest present and readable), ``incomplete`` (no manifest: the
    stage was interrupted or is running), ``corrupt`` (unreadable manifest).
    """
    rows = []
    for iteration, stage, uri in stage_folders(run_root):
        row: dict[str, Any] = {"iteration": iteration, "stage": stage}
        fs, path = filesystem(uri)
        if not fs.exists(f"{path}/{MANIFEST_NAME}"):
            row.update(status="incomplete", rows=None, bytes=None, seconds=None, config_hash=None)
        else:
            try:
                man, _ = read_manifest(uri)
                pruned = pruned_files(uri)  # checkpoint retention: files removed on purpose
                row.update(status="committed" + (" (pruned)" if pruned else ""), rows=man.num_rows,
                           bytes=sum(f.bytes for f in man.files if f.path not in pruned),
                           seconds=man.summary.get("seconds"), config_hash=man.config_hash)
                if stage == "ppo_update":
                    row["checkpoint"] = _checkpoint_kind(uri, man, pruned)
            except ShardError as exc:
                row.update(status="corrupt", rows=None, bytes=None, seconds=None, config_hash=str(exc)[:80])
        row.setdefault("checkpoint", None)
        rows.append(row)
    return rows


def _checkpoint_kind(uri: str, manifest, pruned: dict) -> str:
    """What a committed ``ppo_update`` holds of the policy: ``weights + optimizer`` (a checkpoint
    a run resumes from), ``weights`` (its optimizer state pruned or not written yet),
    ``pruned``, or ``in memory`` (``checkpoint.every`` > 1: the weights stayed in the resident
    workers, or in stage mode's kept trainer; its manifest records their digest, and a resume
    rebuilds them from the checkpoint before it). The weights of a resident checkpoint iteration written in the background are
    in the sibling stage ``ppo_update-policy`` (``weights_stage``)."""
    ref = ShardRef.from_manifest(uri)
    held = weights_stage(ref)
    if held is None:
        return "in memory" if WEIGHTS_DIGEST_KEY in manifest.summary else "-"
    if held.uri != ref.uri:
        manifest, pruned = read_manifest(held.uri)[0], pruned_files(held.uri)
    weights = [f.path for f in manifest.files if f.path.startswith("policy/") and f.path.endswith(WEIGHT_SUFFIXES)]
    if all(w in pruned for w in weights):
        return "pruned"
    opt = optimizer_commit(ref)
    try:
        has_opt = opt.committed(check_files=False) is not None and not pruned_files(opt.uri)
    except ShardError:
        has_opt = False
    return "weights + optimizer" if has_opt else "weights"


def samples_view(run_root: str, iteration: int) -> pa.Table:
    """One row per sample of an iteration: question, response, reward, correctness, advantage
    summary. Stages that are missing leave their columns out."""
    rollout = read_shard(stage_uri(run_root, iteration, "rollout"), stage="rollout")
    cols: dict[str, Any] = {
        "sample_id": rollout.column("sample_id"), "prompt_id": rollout.column("prompt_id"),
        "response_text": rollout.column("response_text"),
        "response_length": pc.list_value_length(rollout.column("response_token_ids")),
        "finish_reason": rollout.column("finish_reason"),
        # multi-turn rollouts (rollout.agent): model turns, environment steps, the environment's reward
        "num_turns": rollout.column("num_turns"),
        "tool_calls": pc.list_value_length(rollout.column("tool_calls")),
        "env_reward": rollout.column("env_reward"),
    }
    try:
        prompts = read_shard(stage_uri(run_root, iteration, "prompts"), stage="prompts")
        q = dict(zip(prompts.column("prompt_id").to_pylist(), prompts.column("question").to_pylist()))
        a = dict(zip(prompts.column("prompt_id").to_pylist(), prompts.column("answer").to_pylist()))
        pids = rollout.column("prompt_id").to_pylist()
        cols["question"] = pa.array([q.get(p) for p in pids], pa.string())
        cols["answer"] = pa.array([a.get(p) for p in pids], pa.string())
    except ShardError:
        pass
    for stage, keep in (("rewards", ("rewards", "correct", "extracted_answer")), ("advantages", ("shaped_rewards",))):
        try:
            t = align_on_sample_id(rollout, read_shard(stage_uri(run_root, iteration, stage), stage=stage), name=stage)
        except ShardError:
            continue
        for c in keep:
            cols[c] = t.column(c)
        if stage == "advantages":
            adv = t.column("advantages").to_pylist()
            cols["advantage_mean"] = pa.array([sum(x) / len(x) if x else 0.0 for x in adv], pa.float32())
            cols["kl_sum"] = pa.array([sum(x) for x in t.column("kl").to_pylist()], pa.float32())
    return pa.table(cols)


def export_table(table: pa.Table, path: str) -> str:
    """Write ``table`` as CSV (list/map columns as JSON text) or JSONL, chosen by the suffix.

    Raises:
        ValueError: a suffix other than .csv or .jsonl.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        with fsspec.open(path, "w") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row, default=str) + "\n")
    elif suffix == ".csv":
        flat = {}
        for name in table.column_names:
            col = table.column(name)
            if pa.types.is_list(col.type) or pa.types.is_map(col.type):
                col = pa.array([json.dumps(v) for v in col.to_pylist()], pa.string())
            flat[name] = col
        with fsspec.open(path, "wb") as f:
            pacsv.write_csv(pa.table(flat), f)
    else:
        raise ValueError(f"export path must end in .csv or .jsonl, got {path!r}")
    return path
