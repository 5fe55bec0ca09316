"""Reliability report: every SIGKILL row of the tests (stage mode on a local disk and the
multi-turn rollout, resident workers, resident FSDP2 ranks, a resident FSDP2 critic gang,
asynchronous RL and partial rollouts, an S3 bucket on a moto server), each run
by the same row function and seed as its test (``tests/faults.py``), tabulated with where the kill
landed and what the rerun redid; and the disk a 20-iteration run keeps under the default
checkpoint retention. Writes the measured sections of docs/reliability.md.

    .venv/bin/python benchmarks/reliability.py [--seed 0] [--repeats 1] [--parts sigkill,resident,fsdp,critic,async,s3,disk]

All parts take about 75 min on 2 quiet cores (measured 2026-11-28, one part per invocation:
resident 31 min, sigkill 18, fsdp 7, s3 6, async 4; disk ~10 on 2026-11-22; critic 2 on 2026-12-02). A part left out keeps its section of the current docs/reliability.md
as it is (``--parts ''`` rewrites only the prose); the prose sections (object storage, the
Prefect server, full disks, corruption) are written from here.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import re
from pathlib import Path

from _env import ROOT, scratch_dir  # noqa: E402  (repository on sys.path, offline environment)

PARTS = ("sigkill", "resident", "fsdp", "critic", "async", "s3", "disk")
SIGKILL_PARTS = ("sigkill", "resident", "fsdp", "critic", "async", "s3")  # their tables have a landed column (tests/test_reliability_doc.py)


def landed_where(o) -> str:
    """The landed column: where the kill landed (the row's stage, and the other stage of an overlap
    row), and the tries; **NO** when it missed."""
    where = f"{o.iteration}: {o.target}" + (f" + {o.also[1]}: {o.also[0]}" if o.also else "")
    tries = f"{o.attempts} {'try' if o.attempts == 1 else 'tries'}"
    return f"{where} ({tries})" if o.landed and o.killed else f"**NO**: {where} missed ({tries})"


def _table(rows) -> list[str]:
    ok = lambda b: "yes" if b else "**NO**"  # noqa: E731
    return [
        "| target stage | iter | phase | killed | kill after (s) | landed (tries) | interrupted (iteration: stages) | partial files | committed | rerun ok | redone | untouched | valid | same weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {o.target} | {o.iteration} | {o.phase}{' (paused)' if o.write_paused else ''} | {o.kill} | {o.delay} | "
          f"{landed_where(o)} | {o.interrupted} | {'yes' if o.partial_files else 'no'} | {o.committed_before} | "
          f"{ok(o.rerun_ok)} | {ok(o.redone)} | {ok(o.committed_untouched)} | {ok(o.all_valid)} | {ok(o.same_weights)} |"
          for o in rows]]


def _values(rows) -> list[tuple]:
    """The values of each row: a test module's ``pytest.param`` (``tests.faults.row``) or a tuple."""
    return [tuple(getattr(p, "values", p)) for p in rows]


def _run_rows(label: str, b, run, rows, args) -> list:
    """``run(baseline, *values)`` for each row's values, ``--repeats`` times: repeat 0 with the
    test's seed when ``--seed 0``, the others in their own folder with the seed salted."""
    import dataclasses

    out = []
    for values in _values(rows):
        for k in range(args.repeats):
            salted = b if (args.seed, k) == (0, 0) else dataclasses.replace(
                b, runs=f"{b.runs.rstrip('/')}/seed{args.seed}-{k}", salt=f"{args.seed}-{k}-")
            out.append(run(salted, *values))
            print(label, out[-1], flush=True)
    return out


def sigkill(d: Path, model: str, api: str, args) -> list[str]:
    from tests import test_faults
    from tests.faults import (agent_row, scenario_baseline, stage_checkpoint_row, stage_every_row, stage_row,
                              write_agent_config, write_config)

    (d / "stage").mkdir()
    b = scenario_baseline(d / "stage", write_config, model, api)
    rows = _run_rows("sigkill", b, stage_row, test_faults.ROWS, args)
    rows += _run_rows("sigkill", b, stage_checkpoint_row, [()], args)
    rows += _run_rows("sigkill", b, stage_every_row, [()], args)
    (d / "agent").mkdir()
    agent = scenario_baseline(d / "agent", write_agent_config, model, api)
    agent_rows = _run_rows("agent", agent, agent_row, test_faults.AGENT_ROWS, args)
    return [*SIGKILL_INTRO, *_table(rows), "",
            "Stage seconds in the uninterrupted run (iteration 1): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(b.timeline.durations(1).items())) + ".", "",
            "The same kill inside a multi-turn rollout (the calculator environment, 3 turns per trajectory,",
            "0.25 s per environment step: `tests/faults.py` `FaultCalculator`;",
            "`tests/test_faults.py::test_sigkill_during_multi_turn_rollout_then_rerun`):", "",
            *_table(agent_rows), "", *SIGKILL_OUTRO]


def resident(d: Path, model: str, api: str, args) -> list[str]:
    from tests import test_faults_resident
    from tests.faults import resident_baseline, resident_checkpoint_row, resident_row

    b = resident_baseline(d, model, api)
    rows = _run_rows("resident", b, resident_row, test_faults_resident.ROWS, args)
    rows += _run_rows("resident", b, resident_checkpoint_row, [()], args)
    return [*RESIDENT_INTRO, *_table(rows), "",
            "Stage seconds in the uninterrupted resident run (iteration 2): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(b.timeline.durations(2).items())) + ".", ""]


def async_part(d: Path, model: str, api: str, args) -> list[str]:
    from tests import test_faults_async
    from tests.faults import async_row, partial_baseline, partial_row, scenario_baseline, write_async_config

    b = scenario_baseline(d, write_async_config, model, api)
    rows = _run_rows("async", b, async_row, test_faults_async.ROWS, args)
    (d / "partial").mkdir()
    partial = _run_rows("partial", partial_baseline(d / "partial", model, api), partial_row, [()], args)
    return [*ASYNC_INTRO, *_table(rows), "", *PARTIAL_INTRO, *_table(partial), ""]


def fsdp(d: Path, model: str, api: str, args) -> list[str]:
    from tests import test_faults_fsdp
    from tests.faults import fsdp_baseline, fsdp_row

    rows = _run_rows("fsdp", fsdp_baseline(d, model, api), fsdp_row, test_faults_fsdp.ROWS, args)
    return [*FSDP_INTRO, *_table(rows), ""]


def critic(d: Path, model: str, api: str, args) -> list[str]:
    from tests.faults import critic_gang_baseline, critic_gang_row

    rows = _run_rows("critic", critic_gang_baseline(d, model, api), critic_gang_row, [()], args)
    return [*CRITIC_INTRO, *_table(rows), ""]



def s3(d: Path, model: str, api: str, args) -> list[str]:
    import s3fs

    from tests import test_object_storage
    from tests.faults import Baseline, MotoServer, baseline_run, s3_row, write_config

    server = MotoServer(d)
    saved = dict(os.environ)
    try:
        env = {**server.env(), "RFT_CACHE_DIR": str(d / "cache")}
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        server.client().create_bucket(Bucket="rft")
        config = write_config(d / "s3.yaml", model)
        weights, timeline = baseline_run(config, "s3://rft/baseline", api, env=env)
        b = Baseline(config, weights, timeline, api, "s3://rft", env=env)
        rows = _run_rows("s3", b, s3_row, test_object_storage.S3_ROWS, args)
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)
    return ["The same kills with `run_root: s3://rft/...` on moto's S3 server (a subprocess on 127.0.0.1), through",
            "s3fs; *untouched* compares each committed object's ETag, LastModified and sha256 before and after",
            "the rerun (`tests/faults.py` `s3_row`, `tests/test_object_storage.py`).", "", *_table(rows), ""]


def _du(root: Path) -> dict[str, int]:
    """Bytes under ``root`` by kind: optimizer state, weights, other checkpoint files, shards, the rest."""
    kinds = {"optimizer state": 0, "weights": 0, "checkpoint config + tokenizer": 0, "shards (Parquet parts)": 0,
             "manifests, metrics, TensorBoard": 0}
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        n = p.stat().st_size
        if p.name == "optimizer.pt":
            kinds["optimizer state"] += n
        elif p.name.endswith((".safetensors", ".bin")):
            kinds["weights"] += n
        elif p.suffix == ".parquet":
            kinds["shards (Parquet parts)"] += n
        elif p.parent.name in ("policy", "critic"):
            kinds["checkpoint config + tokenizer"] += n
        else:
            kinds["manifests, metrics, TensorBoard"] += n
    return kinds


def disk(d: Path, model: str, api: str, args) -> list[str]:
    from flows.train import train
    from rft_core.config import load_config
    from schemas import pruned_files, read_manifest

    base = {"name": "disk", "iterations": args.iterations, "policy.path": model, "data.prompts_per_iteration": 4,
            "data.size": 200, "rollout.n_samples_per_prompt": 4, "rollout.max_new_tokens": 48, "rollout.batch_size": 16,
            "kl.kl_coef": 0.05, "update.lr": 1e-3, "update.micro_batch_size": 4}
    runs = {}
    for label, extra in (("keep everything (`checkpoint.keep_last: null`)", {"checkpoint.keep_last": None}),
                         ("the defaults", {})):
        root = d / f"disk-{len(runs)}"
        train(load_config(None, {**base, **extra, "run_root": str(root)}))
        runs[label] = _du(root)
    kept = runs["the defaults"]
    root = d / "disk-1"
    pruned = sum(e.bytes for m in root.glob("iter=*/*/_MANIFEST.json") for e in read_manifest(str(m.parent))[0].files
                 if e.path in pruned_files(str(m.parent)))
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    labels = list(runs)
    lines = [f"A {args.iterations}-iteration run of the tiny model (4 prompts x 4 samples, 48 new tokens; "
             f"`python benchmarks/reliability.py --parts disk`), MiB on disk at the end:", "",
             f"| kind | {labels[0]} | {labels[1]} |", "|---|---|---|",
             *[f"| {k} | {mib(runs[labels[0]][k])} | {mib(kept[k])} |" for k in kept],
             f"| **total** | **{mib(sum(runs[labels[0]].values()))}** | **{mib(sum(kept.values()))}** |", "",
             f"Pruned files recorded in the manifests of the default run (`_PRUNED.json`): {mib(pruned)} MiB, the "
             "difference.", ""]
    return lines + demo_estimate(runs[labels[0]]["shards (Parquet parts)"] / args.iterations)


def demo_estimate(tiny_shards_per_iteration: float) -> list[str]:
    """The demo's disk per iteration (``configs/grpo_demo.yaml``: SmolLM2-135M, 8 prompts x 4
    samples, 96 new tokens), estimated from the default model's file sizes in the model cache and
    the tiny run's shard bytes per iteration (16 samples x 48 tokens), scaled by samples and tokens."""
    from rft_core.models.hub import cache_dir

    demo = cache_dir() / "models/SmolLM2-135M-Instruct"
    if not (demo / "model.safetensors").exists():
        return ["(The demo estimate needs the default model in the cache: run `make demo` once.)", ""]
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    w = (demo / "model.safetensors").stat().st_size
    tok = sum(p.stat().st_size for p in demo.iterdir() if not p.name.endswith(".safetensors"))
    shards = tiny_shards_per_iteration * (32 / 16) * (96 / 48)
    opt = 2 * w  # AdamW: exp_avg and exp_avg_sq, float32 like the weights (2.0x in the tiny run too)
    return [
        f"The demo (`configs/grpo_demo.yaml`: SmolLM2-135M, float32 weights of {mib(w)} MiB, AdamW state "
        f"~{mib(opt)} MiB), estimated from these file sizes, per iteration:", "",
        f"- keep everything: {mib(w + opt + tok + shards)} MiB per iteration (weights, optimizer state, tokenizer and "
        f"config {mib(tok)}, shards ~{mib(shards)}: the tiny run's shard bytes scaled by samples and tokens);",
        f"- the defaults, steady state: {mib(tok + shards + w / 10)} MiB per iteration (tokenizer and config, shards, "
        f"and every 10th iteration's weights, {mib(w / 10)} amortised), plus a fixed {mib(3 * w + opt)} MiB for the last "
        "iteration's optimizer state and the last 3 iterations' weights. After 100 iterations: "
        f"{(3 * w + opt + 100 * (tok + shards + w / 10)) / 2**30:.1f} GiB instead of {100 * (w + opt + tok + shards) / 2**30:.0f} GiB.",
        ""]


def _sections(text: str) -> dict[str, str]:
    """{part: its generated text} of a report written before (between its begin/end markers,
    less its stamp line)."""
    out = {m.group(1): m.group(2) for m in re.finditer(r"<!-- begin:(\w+) -->\n(.*?)<!-- end:\1 -->", text, re.S)}
    return {k: re.sub(r"^_Measured .*?\._\n\n", "", v) for k, v in out.items()}


PART_FUNCTIONS = {"sigkill": sigkill, "resident": resident, "fsdp": fsdp, "critic": critic, "async": async_part, "s3": s3,
                  "disk": disk}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="random kill points per stage")
    ap.add_argument("--iterations", type=int, default=20, help="iterations of the disk measurement")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which measurements to run: {','.join(PARTS)}")
    ap.add_argument("--out", default=str(ROOT / "docs/reliability.md"))
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        raise SystemExit(f"unknown part(s) {sorted(set(parts) - set(PARTS))}; valid: {', '.join(PARTS)}")
    text = Path(args.out).read_text() if Path(args.out).exists() else ""
    old, stamps = _sections(text), dict(re.findall(r"<!-- begin:(\w+) -->\n_Measured (.*?)\._\n", text))
    new: dict[str, str] = {}
    if parts:
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        from tests.tiny import build_tiny_model

        d = Path(scratch_dir("rft-reliability-"))
        model = build_tiny_model(d / "model")
        with prefect_test_harness(server_startup_timeout=180):
            api = PREFECT_API_URL.value()
            for part in parts:
                (d / part).mkdir()
                load = os.getloadavg()[0]
                new[part] = "\n".join(PART_FUNCTIONS[part](d / part, model, api, args)) + "\n"
                stamps[part] = (f"{_dt.date.today()}, `.venv/bin/python benchmarks/reliability.py --parts {part} --seed "
                                f"{args.seed} --repeats {args.repeats}`, load average {load:.1f} at the start on "
                                f"{os.cpu_count()} cores")
    sections = {k: (f"_Measured {stamps[k]}._\n\n" if k in stamps else "") + new.get(k, old.get(k, "(not measured yet)\n"))
                for k in PARTS}
    text = PROSE.format(**{k: f"<!-- begin:{k} -->\n{v}<!-- end:{k} -->" for k, v in sections.items()})
    Path(args.out).write_text(text)
    print(text)


SIGKILL_INTRO = [
    "Each row: a 2-iteration training (tiny random Llama, 4 prompts x 4 samples, KL on, rewards that",
    "vary inside each group: `tests/varying.py`) runs as a worker subprocess (`python -m flows.cli",
    "train`; stage mode keeping its models, so each update's weights and AdamW state are written in",
    "the background, below). Phase *compute*: once the target stage can start (every stage it waits for committed),",
    "the driver waits as long as the stage waited to start in the uninterrupted run plus a random",
    "part (up to 85%) of its duration there, in the same iteration; phase *write*: it waits until",
    "the stage takes its writer lock (it is writing parts or checkpoint files) plus 0-20 ms; a",
    "Parquet stage writes within a few ms, so its writer is paused 5 s between its parts and its",
    "manifest (*write (paused)*; `tests/faults.py` `PAUSED_WRITES`). Then it sends SIGKILL to the",
    "worker's process group, and runs the same command again (`tests/faults.py` `run_scenario`; each",
    "row is `tests/faults.py` `stage_row`, which `tests/test_faults.py` runs with the same seed).",
    "",
    "Columns: *killed* = what got the SIGKILL: the driver's process group (the flow, and with it its",
    "local Ray and resident workers) or one resident worker; *landed* = where the kill landed, from",
    "the committed manifests right after it: the row's stage of that iteration (both stages, for an",
    "overlap row) not committed and every stage it waits for committed; for a write-phase kill also",
    "its writer lock left behind; for a worker kill also the driver's log naming the worker and the",
    "stage. A kill that would have come after the stage committed is not sent, and the row starts",
    "again with a third of the delay (*tries*); a row that never lands reads **NO** (and its test",
    "fails). *interrupted* = the first iteration with uncommitted stages at the kill, and its first",
    "uncommitted stage in stage order (actor_logprobs, ref_logprobs and rewards run concurrently, so",
    "it may name one of the others); \"computing, no files yet\" = the stage folder did not exist",
    "yet (a stage creates it only when it starts writing);",
    "*partial files* = it had left files (parts, checkpoint files or its lock) that a reader must",
    "not accept; *committed* = stages of the whole run committed at the kill; *redone* = the rerun",
    "committed the interrupted stage anew (a manifest written after the kill); *untouched* = every",
    "committed file has the same mtime and sha256 after the rerun (files that checkpoint retention",
    "pruned on purpose, recorded in `_PRUNED.json`, excepted); *valid* = every shard of the run",
    "passes the validating reader; *same weights* = the final policy equals an uninterrupted run's",
    "bit for bit; each row is what its test asserts (`tests/faults.py` `assert_row`, in",
    "`tests/test_faults.py::test_sigkill_then_rerun` and the other SIGKILL tests).",
    "",
]
RESIDENT_INTRO = [
    "`orchestration.workers: resident` and `checkpoint.every: 3`: a 3-iteration run whose iterations",
    "1 and 2 keep the policy in the resident workers' memory only. Each row kills the driver (its",
    "process group: the flow, its local Ray, the workers with it) or one resident worker (*killed*:",
    "worker; only while it runs a stage program, found by its Ray process title) inside the row's",
    "stage of iteration 2, then runs the same command again; for a worker kill, the run itself first",
    "replaces the worker and goes on. The rerun rebuilds the policy from the initial model by",
    "re-applying the committed updates, and *same weights* compares with STAGE MODE's run (every stage",
    "loads its model, a checkpoint every iteration), which the uninterrupted resident run equals bit",
    "for bit (`tests/faults.py` `resident_row`, `tests/test_faults_resident.py`). Columns as above.",
    "The last row kills the driver while the policy worker writes iteration 3's checkpoint in the",
    "background (`ppo_update-policy`, phase *write*: its writer lock taken, the optimizer stage",
    "before it committed); the rerun starts from the previous checkpoint, re-applies the three",
    "committed updates and writes the checkpoint again (`resident_checkpoint_row`).",
    "",
]
FSDP_INTRO = [
    "The resident scenario with FSDP2 over 2 policy ranks (`update.fsdp: {reshard_after_forward:",
    "true}`, `orchestration.policy_ranks: 2`, 16 new tokens): the driver, or the policy worker's rank",
    "0 (its gang then fails as a whole and the run replaces it), is killed inside iteration 2's",
    "update; the run or its rerun rebuilds the policy on two new ranks from the initial model by",
    "re-applying iteration 1's committed update, and *same weights* compares with the uninterrupted",
    "FSDP2 run (`tests/faults.py` `fsdp_row`, `tests/test_faults_fsdp.py`).",
    "",
]
CRITIC_INTRO = [
    "PPO with GAE and an FSDP2 critic held by a resident gang of 2 ranks (`critic.fsdp`,",
    "`orchestration.critic_ranks: 2`, 16 new tokens, `checkpoint.every: 3`): the gang's rank 0 is",
    "killed inside iteration 2's critic update, while the gang holds the shards and AdamW state of",
    "update 1 (the gang then fails as a whole); the run replaces the gang, whose new ranks restore",
    "them from iteration 1's committed critic and `critic-optimizer/`, and *same weights* compares the",
    "final policy with the uninterrupted run's: iteration 3's values, advantages and update come from",
    "the critic update 2 trained (`tests/faults.py` `critic_gang_row`, `tests/test_faults_critic.py`).",
    "",
]
ASYNC_INTRO = [
    "`rollout.max_staleness: 1`: the rollout of iteration 2 samples with the initial policy and runs",
    "while the update of iteration 1 trains. Each row waits until both can run (the advantages of",
    "iteration 1 and the prompts of iteration 2 committed), then kills the driver inside the stretch",
    "where both ran in the uninterrupted run; *landed* names both stages: neither had committed at",
    "the kill, so both were in flight (`tests/faults.py` `async_row`, `tests/test_faults_async.py`).",
    "",
]
PARTIAL_INTRO = [
    "With partial rollouts (`rollout.partial: {chunk_tokens: 16}` of 48 new tokens, 3 iterations):",
    "the kill lands in iteration 2's rollout while it continues the sequences iteration 1 carried",
    "(mid-chunk, nothing of the chunk committed); the rerun continues the same carried sequences",
    "from the committed carry (`tests/faults.py` `partial_row`).",
    "",
]
SIGKILL_OUTRO = [
    "Why it holds: a stage writes its parts (and checkpoint files) first and its `_MANIFEST.json`",
    "last; a reader accepts only what a manifest lists, with matching sizes and checksums (XXH3-128;",
    "sha256 in manifests written before 2026-11-30). A rerun returns a committed stage whose config",
    "hash matches without recomputing it, takes over the",
    "writer lock of a dead worker (also a lock file it had created but not yet written), clears the",
    "interrupted stage's leftovers and redoes it. Seeds are fixed per iteration and stage; optimizer",
    "state, the KL coefficient and reward statistics are restored from the committed checkpoint and",
    "manifests, so the resumed run is identical (`tests/test_faults.py`).",
    "",
    "The policy's AdamW state is a stage of its own (`ppo_update-optimizer`), written in a background",
    "thread after `ppo_update` committed (`checkpoint.async_optimizer`). A kill during that write",
    "(the `ppo_update-optimizer` row) leaves the update committed and its optimizer stage not: the",
    "rerun reuses the update, recomputes it from the same committed inputs and seeds without",
    "recommitting it, checks the weights against the recorded digest, and commits the optimizer",
    "state (its manifest says `recovered: true`) and the weights, which were not written either, so",
    "iteration 2 starts from the same state.",
    "",
    "With `checkpoint.async_weights` (the default when stage mode keeps its models; the last row of the",
    "table, `tests/faults.py` `stage_checkpoint_row`) stage mode writes the weights in that thread too:",
    "`ppo_update` commits their digest, then the writer commits the optimizer stage and the weights",
    "(`ppo_update-policy`).",
    "The row kills the run while the weights are written (the optimizer stage committed, the weights'",
    "writer lock taken). No process holds that policy any more: the rerun runs iteration 1's update",
    "again from its committed inputs on the initial model, checks the weights against the recorded",
    "digest, writes them, and iteration 2 trains from them to the same final weights.",
]
PROSE = """# Reliability: nothing lost at scale

Each scenario below has a test, named in its row, bounded in time (tiny models, loopback only),
which `make test` runs. The SIGKILL rows take turns: a CI run runs the rows of one of 8
groups (`tests/rotation.py`: the group is the turn in `tests/rotation_turn` mod 8, which every
landing moves on by one with `make rotation-next`; printed at the start and end of the run with the
rows it runs), so every row runs at least once in any 8 consecutive landings on main; `make test-faults-all` runs every row at once. Every SIGKILL row
asserts that the kill was sent, that it landed in the stage and iteration the row names (from
the committed manifests at the kill), and that the interrupted stage was redone. The measured
sections (tables) are written by `benchmarks/reliability.py`, which runs the tests' own rows
(`tests/faults.py` `stage_row`, `agent_row`, `resident_row`, `resident_checkpoint_row`, `fsdp_row`,
`critic_gang_row`, `async_row`, `partial_row`, `s3_row`), each with the
command, date and machine load that produced it.

| scenario | CI test | what must hold |
|---|---|---|
| SIGKILL inside every stage, local disk: the compute phase of each of the 7 stages of iteration 1, the write phase of each (a Parquet stage's writer paused between its parts and its manifest so that the kill lands there), iteration 2's rollout and update, iteration 2's update committing (with the weights' digest), the optimizer state's background write, the weights' background write (`checkpoint.async_weights`, the default), iteration 2's rollout of a run with `checkpoint.every: 2` (whose policy 1 lived in the driver's memory only: the rerun rebuilds it), and 2 multi-turn rollouts (22 rows, in the rotation) | `tests/test_faults.py` | rerun resumes; the interrupted stage redone; committed files untouched; final weights bit-identical to an uninterrupted run's |
| `run_root: s3://...` (a real S3 server: moto, on 127.0.0.1) | `tests/test_object_storage.py`, `tests/schemas/test_object_store.py` | full training; SIGKILL in rollout and update then resume (same ETags; 2 rows, in the rotation); inspect, replay, eval, pandas and DuckDB read the bucket; manifest-last without renames; one of two writers commits |
| bad storage: missing bucket, wrong credentials, unreachable endpoint, read-only bucket or folder | `tests/test_object_storage.py` | refused before any stage starts, naming the URI and the cause |
| the Prefect API server dies during the rollout, comes back | `tests/flows/test_server_outage.py` | the outage landed while the run was in flight (the server had it Running, its prompts were committed and its update was not, and every later stage committed after the kill); the flow run ends (continues, or fails loudly and a UI-style retry completes); stages committed before the outage untouched |
| the disk fills up mid-run (a 64 MiB tmpfs) | `tests/test_disk_full.py` | the error names the stage, the run and the cause; no manifest for the partial stage; the previous checkpoint intact; the same command resumes once space is freed |
| a flipped bit in a committed checkpoint or shard | `tests/test_corruption.py`, `tests/schemas/test_storage.py` | refused on resume naming the file; `repair` recomputes exactly that stage and what depends on it |
| SIGKILL of the driver (in each of the 7 stages) or of a resident worker (in each of the 4 model stages: rollout, actor, reference, update; the driver's log must name the killed worker and the stage), `orchestration.workers: resident`, `checkpoint.every: 3`, in iteration 2 (whose policy exists only in memory), and of the driver (its workers with it) while the policy worker writes iteration 3's checkpoint in the background (12 rows, in the rotation) | `tests/test_faults_resident.py` | the rerun (or, for a worker, the run itself, which replaces it) rebuilds the policy from the last checkpoint by re-applying the committed updates; the interrupted stage redone; committed files untouched; final weights bit-identical to stage mode's (an uninterrupted run with a checkpoint every iteration) |
| SIGKILL of the policy worker's rank 0 or of the driver inside iteration 2's update of a resident FSDP2 run (`update.fsdp`, `orchestration.policy_ranks: 2`, `checkpoint.every: 3`; 2 rows, in the rotation) | `tests/test_faults_fsdp.py` | the run (worker kill: it replaces the 2-rank gang) or its rerun rebuilds the policy on two new ranks from the initial model by re-applying iteration 1's committed update; the interrupted stage redone; committed files untouched; final weights bit-identical to the uninterrupted FSDP2 run's |
| SIGKILL of the critic gang's rank 0 inside iteration 2's critic update of a PPO run with GAE and an FSDP2 critic held by a resident gang (`critic.fsdp`, `orchestration.critic_ranks: 2`, `checkpoint.every: 3`; 1 row, in the rotation) | `tests/test_faults_critic.py` | the run replaces the 2-rank gang, whose new ranks restore the critic's shards and AdamW state from iteration 1's committed critic and `critic-optimizer/` and redo the update; committed files untouched; final policy bit-identical to the uninterrupted run's |
| SIGKILL while the rollout of iteration 2 and the update of iteration 1 run side by side (`rollout.max_staleness: 1`; 2 rows, in the rotation) | `tests/test_faults_async.py` | the kill landed while both were in flight (both could start, neither had committed); rerun reuses every committed stage and redoes both; the rollout samples with the scheduled policy whatever had finished; final weights bit-identical to an uninterrupted run |
| SIGKILL in the rollout of iteration 2 of a run with partial rollouts (`rollout.partial.chunk_tokens: 16` of 48 tokens, `rollout.max_staleness: 1`), while it continues the sequences iteration 1 carried (mid-chunk: after the rollout's log line `rollout: continuing ...` that it starts generating, which the row asserts came before the kill; in the rotation) | `tests/test_faults_async.py` | the rerun continues the same carried sequences from the committed carry (nothing lives only in memory) and redoes the rollout; committed files untouched; final weights bit-identical to an uninterrupted run (iteration 3 trains the groups iteration 1 started) |
| bounded disk by default | `tests/rft_core/stages/test_retention.py`, `tests/flows/test_retention_flow.py` | optimizer state of the last iteration, weights of the last 3 and every 10th; resume and replay never need a pruned file |

## SIGKILL on a local disk

{sigkill}
A run that fails (an error, not a kill) after an update returns once that update's background
writes have landed (`rft_core.api.release_run`): none outlives the failed run into the next flow
of the same process, and a write that fails raises there, naming its stage
(`tests/flows/test_replay.py::test_replay_refuses_missing_inputs`).

## SIGKILL with resident workers

{resident}
## SIGKILL with resident FSDP2 ranks

{fsdp}
## SIGKILL in a resident critic gang

{critic}
## SIGKILL during asynchronous RL

{async}
## Object storage

Any fsspec URI works as `run_root`; for S3 install `s3fs` and give the endpoint and credentials
the usual way (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, a profile, or an instance role;
`AWS_ENDPOINT_URL` for MinIO, Ceph, R2 or a local server):

```bash
export AWS_ENDPOINT_URL=http://127.0.0.1:9000        # only for a server other than AWS
.venv/bin/rft train -c configs/grpo_demo.yaml --run-root s3://my-bucket/runs/demo
.venv/bin/rft inspect s3://my-bucket/runs/demo
.venv/bin/rft eval s3://my-bucket/runs/demo -c configs/grpo_demo.yaml
```

```python
import duckdb, pandas as pd, s3fs
pd.read_parquet("s3://my-bucket/runs/demo/iter=000001/rollout")      # _MANIFEST.json is skipped
con = duckdb.connect(); con.register_filesystem(s3fs.S3FileSystem())  # DuckDB reads s3:// through fsspec
con.sql("select count(*) from 's3://my-bucket/runs/demo/iter=*/rollout/*.parquet'")
```

With resident workers on a Ray cluster (`orchestration.workers: resident`), the driver's `AWS_*`
and `FSSPEC_*` variables (with `RFT_*`, `HF_*`, `TRANSFORMERS_*`, `TOKENIZERS_*`) go to every
worker as the job's `runtime_env` `env_vars`, so a worker on another node reaches the bucket
with the driver's credentials and endpoint although its node was started without them
(`tests/test_two_nodes.py::test_credentials_only_in_the_driver_reach_the_workers_on_two_nodes`);
`ray.init_kwargs.runtime_env.env_vars` wins over them. Ray keeps a job's runtime environment
where anyone who can reach its dashboard can read it: on a shared cluster give the nodes a
profile or an instance role instead of keys.

What holds on a store without rename:

- **Manifest-last.** Every part is one PUT, which S3 makes visible whole or not at all (no
  temporary object and no copy, which is what a "rename" costs there); `_MANIFEST.json` is the
  last PUT of a stage. A reader never accepts a folder without a manifest, whatever parts it
  holds (`tests/schemas/test_object_store.py` writes every part of a stage and no manifest:
  `read_shard` refuses it, `committed_ref` says "not committed", `inspect` shows "incomplete").
- **Conditional writes.** The writer lock and the manifest are created with
  `pipe_file(mode="create")`, which s3fs sends as `PutObject` with `If-None-Match: *`; the server
  refuses the second create of an existing key (412), s3fs raises `FileExistsError`. AWS S3 has
  honoured this since August 2024, MinIO does, and so does moto's server (the tests check it:
  eight threads race to create one key, exactly one wins). So two writers never both hold a fresh
  lock, and two writers never both commit: the loser of the manifest PUT gets "committed by
  another writer a moment ago (its manifest won the conditional write)" and its result is
  discarded.
- **What the lock does not guarantee.** Taking over the lock of a dead writer is a delete then a
  conditional create; S3 has no conditional delete in s3fs, so two writers taking over the same
  dead lock at the same instant can both believe they hold it. Both then write the same part
  names; the manifest's conditional PUT still lets only one commit, and its checksums are those
  of the objects it read back, so a loser that overwrites a part *after* the winner committed
  makes the stage fail its checksum (refused, `repair` recomputes it), never silently wrong.
  With deterministic seeds both writers write the same bytes anyway. On a filesystem without
  conditional writes (fsspec's generic `mode="create"` is check-then-write) the same holds for
  the lock, and the manifest is last-writer-wins.
- **Listings.** s3fs caches directory listings; every check of the protocol drops the cache of
  the stage folder first, so a stage committed by another process is never taken for leftovers
  (the test commits through a second client after the first cached the folder).
- **No bucket is ever created.** s3fs's `makedirs` creates a missing bucket; the stage writer
  never calls it on an object store, and the preflight refuses a missing bucket first.
- **Checkpoints** are uploaded from a local temporary folder before the manifest; loading one
  downloads it once into `~/.cache/prefect-rft/checkpoints/<manifest sha256>`, checks every file
  against the manifest before the atomic rename into the cache, and reuses it from there.

{s3}
## Bad input is refused before any stage starts

`train` first writes, reads back and deletes a probe object under `run_root`
(`rft_core.storage.check_run_root`; also `rft check RUN_ROOT`), with a
client that gives up after one quick try, and stops with `RunRootError` naming the URI and the
cause:

| input | message (`tests/test_object_storage.py`) |
|---|---|
| a bucket that does not exist | `run_root 's3://no-such-bucket/run': the bucket 'no-such-bucket' does not exist (endpoint http://127.0.0.1:PORT): create it, or fix run_root. No stage was started.` |
| wrong credentials | `run_root 's3://guarded/run': the credentials were refused (endpoint ...): The AWS Access Key Id you provided does not exist in our records. ...` |
| an unreachable endpoint | `run_root 's3://guarded/run': cannot reach the storage endpoint (endpoint http://127.0.0.1:PORT): Could not connect to the endpoint URL ...` (in under 20 s) |
| a read-only bucket (a policy with only `s3:GetObject`, `s3:ListBucket`) | `run_root 's3://guarded/run': cannot write a file there: Access Denied (a read-only bucket, or a policy without s3:PutObject/s3:DeleteObject); choose a writable run_root. ...` |
| a read-only local folder | `run_root '/ro/run': cannot create the run folder: [Errno 30] Read-only file system ...` |

## The Prefect server dies mid-run

`tests/flows/test_server_outage.py` starts the deployment stack (`prefect server start` on a
free port with its own database, the `local` process pool, `prefect deploy --all`, a worker),
runs `rft-train-preset/grpo-demo`, SIGKILLs the server's process group as soon as iteration 1's
prompts are committed, and restarts it on the same port and database 20 s later. What Prefect
3.8 did in that window:

- The stages kept running and committing: task-run states are orchestrated in the flow-run
  process and only *reported* to the server as events. Every stage of iteration 1 committed
  within 3 s of the kill, with the server down.
- Those events were lost: the events client logs "Unable to connect to
  'ws://.../api/events/in' ... event data (including task run data) may be lost" and drops them,
  so the UI shows those task runs stuck in their last reported state (or not at all), although
  the stages committed. The shard manifests (`rft inspect`) are the record that counts.
- The cancellation and suspension observers fall back from their websocket to polling, and
  after three failed polls log "Cancellation observer failed. Flow run cancellation disabled"
  (cancelling that flow run from the UI then does nothing; `PREFECT_RUNNER_CRASH_ON_CANCELLATION_FAILURE=true`
  crashes the run instead).
- The first API call the flow needs (the iteration's artifacts, the subflow's final state)
  retries with exponential backoff (2, 4, 8, 16, 32 s: `PREFECT_CLIENT_MAX_RETRIES=5`); the server
  came back within that window, the call went through and the run finished `Completed`, with
  every stage committed before the outage untouched.
- A longer outage (100 s; `RFT_OUTAGE_SECONDS=100` runs the same test, by hand): again every
  stage committed within 15 s of the kill; the API call outlived its retries (about a minute),
  the flow raised, and once the server was back the run was recorded `Failed: Flow run
  encountered an exception: ConnectError: [Errno 111] Connection refused`: loud, not a run left
  "Running". Setting it to `AwaitingRetry` (as the UI's Retry button does) ran it again in the
  worker: every stage was reused from its manifest, nothing recomputed, and it completed.
  (Not tested: a server still down when the flow-run process gives up on reporting its final
  state; the server then shows the run "Running" until it is marked crashed or retried by hand.)

Either way nothing committed is lost: a retry (the UI's Retry button, or the API call the test
makes: state `AwaitingRetry`) reuses every committed stage with its files untouched. Operators:
keep the server's downtime under about a minute (a supervisor restarting `prefect server start`),
or raise `PREFECT_CLIENT_MAX_RETRIES` on the workers.

## The disk fills up

`tests/test_disk_full.py` mounts a 64 MiB tmpfs as the run's disk; once iteration 2's prompts
are committed another file takes every free byte. The next stage fails while writing, with:

```
StorageError: writing stage iter=2/rollout of run /mnt/disk/run failed at /mnt/disk/run/iter=000002/rollout/.writer.lock:
No space left on device [errno 28: ENOSPC] (0 B free of 64.0 MiB on that filesystem). Nothing of this stage was
committed (it has no _MANIFEST.json) and the committed stages are untouched; free space (or keep fewer checkpoints:
checkpoint.keep_last, checkpoint.keep_weights_last) and rerun the same command: the run resumes at this stage.
```

The failed stage has no manifest, iteration 1's files (checkpoint included) keep their mtimes and
checksums and verify, and once the file is deleted the same `train` command resumes at that
stage and finishes. Every write of the shard protocol (the lock, Parquet parts, the manifest,
`_PRUNED.json`) names its stage this way (`schemas.storage.storage_errors`); so does a read-only
filesystem, a quota, or a permission error. A lock file created but not written (the disk filled
between the two) is removed, and one left by a killed writer is taken over.

## Corrupted files

A committed file is checked against its manifest's checksum (XXH3-128; sha256 in manifests
written before 2026-11-30) wherever it is used:

- a Parquet part, by every `read_shard`, and when a committed stage is reused on resume
  (`committed_ref`; parts are small);
- a checkpoint (weights, tokenizer, config, `optimizer.pt`), when a stage loads it
  (`rft_core.stages.checkpoints`): before this, one flipped bit in iteration 1's
  `policy/model.safetensors` went unnoticed and iteration 2 trained on from damaged weights. A
  file that this process committed or checked before, unchanged since (size, mtime), is not
  hashed again, so a run pays for the check only when it resumes or loads a checkpoint written by
  another process: about 0.1 s per GB (0.7-1 s per GB with sha256; `make bench-checksums`).

The error names the file and the command that repairs it, e.g. on resume:

```
ShardCorruptError: /runs/x/iter=000001/ppo_update/policy/model.safetensors: checksum does not match the manifest:
the committed file is corrupted. To recompute this stage and the stages that depend on it (moved aside, nothing else
touched): rft repair /runs/x --stage iter=1/ppo_update, then rerun the same training command
```

```bash
.venv/bin/rft verify /runs/x                                            # every committed file vs its manifest
.venv/bin/rft repair /runs/x --stage iter=1/ppo_update --dry-run        # what would move, and why
.venv/bin/rft repair /runs/x --stage iter=1/ppo_update
.venv/bin/rft train -c configs/grpo_demo.yaml --run-root /runs/x        # recomputes exactly those stages
```

`repair` moves the stage and every committed stage that depends on it to
`{{run}}/_repaired/<UTC time>/` (nothing is deleted; `_REPAIR.json` there says what moved and
why). Dependents: stages whose manifest lists a moved stage among its inputs (transitively), and,
once a `ppo_update` or `critic_update` of iteration j moves, every stage with inputs of the
iterations after j (they start from that checkpoint); stages without inputs (`prompts`) stay. It
refuses a stage whose files all verify (`--force` to move it anyway) and a stage being written.
In `tests/test_corruption.py` the repaired update is recomputed bit for bit (same weights sha256
on CPU) and every other committed file of the run keeps its mtime and checksum.

## Bounded disk by default

`checkpoint` defaults (`rft_core/config/run.py`, applied after each iteration by
`rft_core.stages.retention`): the optimizer state is kept for the last iteration only
(`keep_last: 1`); older checkpoints also lose their weights (`prune: weights`) except the last 3
iterations (`keep_weights_last: 3`) and every 10th (`keep_weights_every: 10`); configs,
tokenizers, shards and manifests are always kept. `checkpoint.keep_last: null` keeps everything.
A resume never needs a pruned file (iteration i+1 starts from iteration i, pruned only after
i+1 committed; with `rollout.max_staleness` s the versions i-s .. i the next rollouts sample with
keep their weights: `rft_core.stages.retention.staleness_floor`); replay reads only shards; evaluating a pruned checkpoint says what is missing:
`.../iter=000001/ppo_update: checkpoint file(s) policy/model.safetensors were pruned
(checkpoint.prune=weights (keep_weights_last=3, keep_weights_every=10) after iteration 4)`.

{disk}"""


if __name__ == "__main__":
    main()
