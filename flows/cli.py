"""Command-line entry point: ``rft train --config configs/grpo_demo.yaml --set rollout.temperature=0.7``."""
from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL fine-tuning as Prefect flows over Parquet shards.")


@app.callback()
def _root() -> None:
    """RL fine-tuning as Prefect flows over Parquet shards."""


def _resolve_run_root(run_root: str, name: str) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = run_root.format(timestamp=stamp, name=name)
    if "://" not in root:
        root = str(Path(root).expanduser().resolve())
    return root


@app.command()
def train(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML preset (see configs/)."),
    set_: List[str] = typer.Option([], "--set", "-s", help="Dotted override, repeatable: --set rollout.temperature=0.7"),
    run_root: Optional[str] = typer.Option(None, "--run-root", help="Run folder (any fsspec URI). Reuse one to resume a run."),
) -> None:
    """Train with GRPO/PPO; prints one metrics line per iteration and where the results are."""
    from rft_core.config import ConfigError, load_config

    overrides = list(set_) + ([f"run_root={run_root}"] if run_root else [])
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    cfg = cfg.model_copy(update={"run_root": _resolve_run_root(cfg.run_root, cfg.name)})
    typer.echo(f"run root: {cfg.run_root}")
    from flows.train import train as train_flow

    result = train_flow(cfg)
    typer.echo("")
    typer.echo(f"shards:      {result.run_root}/iter=*/<stage>/part-*.parquet (+ _MANIFEST.json)")
    typer.echo(f"metrics:     {result.metrics_uri}")
    typer.echo(f"checkpoints: {result.run_root}/iter=*/ppo_update/policy (final: {result.final_policy.uri}/policy)")
    typer.echo(f"resume:      rerun with --run-root {result.run_root}")


def main() -> None:
    """Console-script entry."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
