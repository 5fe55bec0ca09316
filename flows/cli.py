"""Command-line entry point: ``rft train --config configs/grpo_demo.yaml --set rollout.temperature=0.7``;
``rft data check data/train.jsonl -c configs/grpo_my_data.yaml`` before training on your own files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL fine-tuning as Prefect flows over Parquet shards.")


@app.callback()
def _root() -> None:
    """RL fine-tuning as Prefect flows over Parquet shards."""


def _load_or_exit(config: Optional[Path], overrides: list[str]):
    """The resolved TrainConfig, or exit 2 with the config error on stderr."""
    from rft_core.config import ConfigError, load_config

    try:
        return load_config(config, overrides).with_resolved_run_root()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


@app.command()
def train(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML preset (see configs/)."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, repeatable: --set rollout.temperature=0.7"),
    run_root: Optional[str] = typer.Option(None, "--run-root", help="Run folder (any fsspec URI). Reuse one to resume a run."),
) -> None:
    """Train with GRPO/PPO; prints one metrics line per iteration and where the results are."""
    cfg = _load_or_exit(config, list(set_) + ([f"run_root={run_root}"] if run_root else []))
    typer.echo(f"run root: {cfg.run_root}")
    from rft_core.api import (DatasetError, RewardError, RunRootError, check_judge_keys, check_run_root,
                              validate_run_data)
    from schemas import ShardError, StorageError

    try:
        # before the flow (and a temporary Prefect server) starts: the run root, then every data row
        # and the LLM judges' API keys (the flow checks them again; a passed data check is cached
        # under the run root)
        check_run_root(cfg.run_root)
        typer.echo(validate_run_data(cfg).summary())
        judges = check_judge_keys(cfg.reward)
        if judges:
            typer.echo(judges)
        from flows.train import train as train_flow

        result = train_flow(cfg)
    except (RunRootError, StorageError, DatasetError, ShardError, RewardError) as exc:  # ShardError: e.g. an older run
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo("")
    typer.echo(f"shards:      {result.run_root}/iter=*/<stage>/part-*.parquet (+ _MANIFEST.json)")
    typer.echo(f"metrics:     {result.metrics_uri}")
    typer.echo(f"checkpoints: {result.run_root}/iter=*/ppo_update[-policy]/policy "
               f"(final: {result.final_policy_folder})")
    typer.echo(f"resume:      rerun with --run-root {result.run_root}")


@app.command()
def check(run_root: str = typer.Argument(..., help="Run folder (any fsspec URI), existing or not.")) -> None:
    """Check that this process can write, read back and delete a file under a run root (object storage: bucket,
    endpoint, credentials), as train does first; exits 1 naming the cause when it cannot."""
    from rft_core.api import RunRootError, check_run_root

    try:
        typer.echo(check_run_root(run_root))
    except RunRootError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)


@app.command()
def verify(run_root: str = typer.Argument(..., help="Run folder (any fsspec URI).")) -> None:
    """Check every committed file of a run against its manifest (size and checksum)."""
    from rft_core.api import verify_run

    try:
        bad = verify_run(run_root)
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    for key, problem in bad.items():
        typer.echo(f"CORRUPT {key}: {problem}\n  repair: rft repair {run_root} --stage {key}")
    typer.echo(f"{len(bad)} corrupt stage(s)" if bad else "every committed file matches its manifest")
    raise typer.Exit(1 if bad else 0)


@app.command()
def repair(
    run_root: str = typer.Argument(..., help="Run folder (any fsspec URI)."),
    stage: str = typer.Option(..., "--stage", help="The damaged stage, iter=N/<stage> (e.g. iter=1/ppo_update)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would move, and why."),
    force: bool = typer.Option(False, "--force", help="Move the stage even when every file of it verifies."),
) -> None:
    """Move a corrupted stage and every stage that depends on it to {run}/_repaired/<time>/; rerunning
    train recomputes them."""
    from rft_core.api import repair_stage

    try:
        plan = repair_stage(run_root, stage, dry_run=dry_run, force=force)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if plan.problem:
        typer.echo(f"{plan.target}: {plan.problem}")
    for key, why in plan.moves.items():
        typer.echo(f"  {'would move' if dry_run else 'moved'}: {key} ({why})")
    if not dry_run:
        typer.echo(f"moved to {plan.moved_to}; rerun the same train command with --run-root {run_root}")


@app.command()
def replay(
    source_run_root: str = typer.Argument(..., help="Run folder whose shards are replayed."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML preset with the new settings."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, repeatable."),
    run_root: str = typer.Option(..., "--run-root", help="New run folder for the replayed stages."),
) -> None:
    """Rerun advantages + update of a saved run with other settings; nothing is generated."""
    cfg = _load_or_exit(config, list(set_) + [f"run_root={run_root}"])
    from flows.replay import replay as replay_flow

    result = replay_flow(source_run_root, cfg)
    typer.echo(f"replayed {source_run_root} into {result.run_root} (final policy: {result.final_policy_folder})")


@app.command("eval")
def eval_(
    checkpoint: Optional[str] = typer.Argument(
        None, help="What to score: a run folder (its last checkpoint), an iter=N/ppo_update folder or its policy/ "
                   "folder, a local HF model folder, or the default model's alias. Default: the config's policy.path."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML preset of the training run: its data "
                                          "(task, seed, size) defines the held-out split, or eval.path names a file of "
                                          "held-out rows (required with data.source=files); its reward grades."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, repeatable: --set eval.num_prompts=100 "
                                   "(eval.seed, eval.max_new_tokens, eval.batch_size too; eval.n_samples=8 samples 8 "
                                   "answers per prompt: avg@8, pass@1..8, maj@8; eval.temperature, eval.top_p, "
                                   "eval.sampling_seed)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Folder (any fsspec URI) for the eval stages. Default: "
                                      "{run}/eval/iter=N-<hash> for a run checkpoint, else runs/eval/<name>-<hash>."),
) -> None:
    """Score a checkpoint on held-out prompts (greedy): accuracy and mean reward; with eval.n_samples > 1 sampled
    answers: avg@n, pass@1..n and maj@n with standard errors. The prompts are a split of the training task disjoint
    from its training data, or the first eval.num_prompts rows of eval.path (GSM8K, MATH-500 and AIME files as the
    hub ships them are read without a mapping)."""
    from rft_core.config import ConfigError, load_config

    try:
        cfg = load_config(config, list(set_))
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    from flows.eval import evaluate
    from rft_core.api import eval_report_lines
    from schemas import ShardError

    try:
        result = evaluate(cfg, checkpoint, out)
    except (ShardError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    s = result.summary
    typer.echo("")
    typer.echo(f"checkpoint:  {result.policy}")
    report = eval_report_lines(s)  # sampled answers: avg@n, pass@1..n, maj@n
    if report:
        for line in report:
            typer.echo(line)
    else:
        typer.echo(f"accuracy:    {result.accuracy:.3f} ± {s['accuracy_stderr']:.3f} ({result.num_prompts} held-out prompts, greedy)")
    se = s["reward_stderr"]
    typer.echo(f"mean reward: {result.reward_mean:.3f} ± {'n/a' if se is None else f'{se:.3f}'}")
    typer.echo(f"samples:     {result.shard.uri} (+ prompts, rollout, rewards under {result.out_root})")


@app.command()
def inspect(
    run_root: str = typer.Argument(..., help="Run folder (any fsspec URI)."),
    iteration: Optional[int] = typer.Option(None, "--iteration", "-i", help="Show this iteration's samples."),
    stage: Optional[str] = typer.Option(None, "--stage", help="With --export: export this stage's shard instead of the sample view."),
    samples: int = typer.Option(8, "--samples", "-n", help="How many samples to show."),
    export: Optional[str] = typer.Option(None, "--export", help="Write the view (or --stage shard) to a .csv or .jsonl file."),
    sample: Optional[str] = typer.Option(None, "--sample", help="With -i: show this sample_id turn by turn (model turns, "
                                         "tool calls, observations, final answer, reward)."),
) -> None:
    """List iterations and stages with status, rows and sizes; show or export samples."""
    from rich.console import Console
    from rich.table import Table

    from rft_core.api import export_table, run_status, samples_view
    from schemas import ShardError, read_shard, stage_uri

    console = Console()
    try:
        if iteration is None:
            rows = run_status(run_root)
            table = Table(title=run_root)
            for col in ("iteration", "stage", "status", "rows", "bytes", "seconds", "config_hash"):
                table.add_column(col)
            for r in rows:
                secs = f"{r['seconds']:.2f}" if isinstance(r["seconds"], (int, float)) else "-"
                table.add_row(str(r["iteration"]), r["stage"], r["status"], str(r["rows"] if r["rows"] is not None else "-"),
                              str(r["bytes"] if r["bytes"] is not None else "-"), secs, str(r["config_hash"] or "-"))
            console.print(table)
            kinds: dict[str, list[str]] = {}
            for r in rows:
                if r["checkpoint"]:
                    kinds.setdefault(r["checkpoint"], []).append(str(r["iteration"]))
            console.print("policy by iteration: " + ("; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items())
                                                   or "no committed update yet"))
            return
        if sample is not None:
            from rft_core.api import sample_transcript

            typer.echo(sample_transcript(run_root, iteration, sample))
            return
        view = (read_shard(stage_uri(run_root, iteration, stage)) if stage else samples_view(run_root, iteration))
        if export:
            typer.echo(f"wrote {view.num_rows} rows to {export_table(view, export)}")
            return
        table = Table(title=f"{run_root} iteration {iteration}")
        shown = [c for c in ("sample_id", "question", "response_text", "rewards", "correct", "advantage_mean")
                 if c in view.column_names] or view.column_names[:6]
        for col in shown:
            table.add_column(col, overflow="fold")
        for row in view.slice(0, samples).to_pylist():
            table.add_row(*[str(row[c])[:300] for c in shown])
        console.print(table)
    except (ShardError, FileNotFoundError, ValueError, KeyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface the Prefect server listens on."),
    port: int = typer.Option(4200, "--port", "-p", min=1, max=65535,
                             help="Server port; the UI is at http://HOST:PORT. A Prefect server already "
                                  "answering there is reused (and left running on exit)."),
    gpu_limit: int = typer.Option(1, "--gpu-limit", min=0,
                                  help="Slots of the `gpu` tag concurrency limit: how many model-holding stages "
                                       "run at once (0: leave the server's limits as they are)."),
    deploy: bool = typer.Option(True, "--deploy/--no-deploy", help="Run `prefect deploy --all` (prefect.yaml)."),
    worker: bool = typer.Option(True, "--worker/--no-worker",
                                help="Start a process worker for the `local` pool (its flow-run logs print here)."),
    poll_seconds: float = typer.Option(5.0, "--poll-seconds", min=0.5,
                                       help="How often the worker asks the server for scheduled runs."),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir",
                                           help="Folder for the server's output. Default: $PREFECT_HOME/serve."),
) -> None:
    """Start a local Prefect server, the `local` process work pool, the `gpu` concurrency limit,
    the deployments of prefect.yaml and a worker; run until Ctrl-C, then stop what it started."""
    import signal
    import time

    from flows.serve import ServeError, start_stack

    try:
        stack = start_stack(host, port, gpu_limit=gpu_limit, deploy=deploy, worker=worker, poll_seconds=poll_seconds,
                            log_dir=log_dir, echo=typer.echo)
    except ServeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)

    def _interrupt(*_):  # SIGTERM stops the stack like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    typer.echo("")
    typer.echo(f"UI:       {stack.ui_url}")
    typer.echo(f"API:      export PREFECT_API_URL={stack.api_url}")
    typer.echo("run:      prefect deployment run 'rft-train-preset/grpo-demo' --watch   "
               "(-p overrides='{\"iterations\": 4}' to change settings)")
    typer.echo("stop:     Ctrl-C")
    try:
        while True:
            if stack.worker is not None and stack.worker.poll() is not None:
                typer.echo(f"error: the worker exited with {stack.worker.returncode}", err=True)
                raise typer.Exit(1)
            if stack.server is not None and stack.server.poll() is not None:
                typer.echo(f"error: the server exited with {stack.server.returncode}; see {stack.log_dir}/server.log", err=True)
                raise typer.Exit(1)
            time.sleep(1)
    except KeyboardInterrupt:
        typer.echo("stopping the worker and the server ...")
    finally:
        stack.stop()


data_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Your own training data: check a dataset before training on it.")
app.add_typer(data_app, name="data")


@data_app.command("check")
def data_check(
    path: Optional[str] = typer.Argument(
        None, metavar="PATH", help="Dataset to check: a .parquet/.jsonl/.json/.csv file, a glob, a folder, a "
                                   "datasets.save_to_disk folder or any fsspec URI. Default: the config's data.path "
                                   "(or its data.sources mixture)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML preset whose data settings (format, "
                                          "columns, system_prompt, prompt_template, max_prompt_tokens) and policy "
                                          "tokenizer are used, as training would."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, repeatable: --set data.columns.prompt=input"),
    examples: int = typer.Option(2, "--examples", "-n", min=0, help="How many prompts to render as the policy sees them."),
) -> None:
    """Check a dataset as training reads it: detected format, column mapping, row count, the first
    prompts exactly as the policy sees them, and every problem of its rows, found by the same checks
    (and reported with the same messages) as `rft train` runs before its first stage. Exits 1 when
    there are problems."""
    cfg = _load_or_exit(config, list(set_))
    from rft_core.api import check_config_data

    report = check_config_data(cfg, path, n_examples=examples)
    typer.echo(report.render())
    if not report.ok:
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
