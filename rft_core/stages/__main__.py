"""Command line of the stage programs: ``python -m rft_core.stages <stage> ...``.

Runs exactly the function a Prefect task calls in-process (same reuse-or-compute, same
manifest), with the program's stage input model (``rft_core.stages.contracts``) built from:

  --input FILE       the whole input model as JSON (what the subprocess runner passes), or
  --arg NAME=VALUE   one field of the input model. VALUE is JSON (a ShardRef or config as an
                     object, a number, a quoted string), ``@file.json``, the URI of a committed
                     stage folder (for a ShardRef field), or a plain string.
  --config FILE      a training config (YAML preset); fields not given with --arg are taken
                     from it (the model's ``config_paths``: e.g. ``rollout`` of the rollout
                     program is the config's ``rollout`` section).
  --set KEY=VALUE    dotted override of --config (repeatable).
  --iteration K      the iteration the stage belongs to: the input's ``iteration`` field if it
                     has one, and what --config fills in per iteration: below float32 an actor or
                     reference pass packs the rows of iteration K's update
                     (``TrainConfig.logprob_grouping_at``), so there a pass given --config needs it.
  --out URI          the stage's output folder (the ``out`` field).
  --result FILE      write the program's return value (ShardRef JSON) there; under torchrun only
                     rank 0 writes it.

Example (a rollout of iteration 1 of a run whose prompts stage is committed)::

    python -m rft_core.stages rollout --config configs/grpo_demo.yaml --set rollout.max_new_tokens=64 \\
        --arg prompts=runs/demo/iter=000001/prompts --arg iteration=1 --out runs/demo/iter=000001/rollout

Exit status 0 on success, 1 on any error (traceback on stderr), 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import logging
import operator
import os
import sys
from pathlib import Path
from typing import Any

from rft_core.config import load_config
from rft_core.models.hub import configure_cuda_backends
from rft_core.stages.writer import wait_for_optimizer_writes
from rft_core.stages.runner import DISTRIBUTED_STAGES, INPUTS, PROGRAMS, encode_result, input_from_args


def _parse_value(text: str) -> Any:
    if text.startswith("@"):
        return json.loads(Path(text[1:]).read_text())
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parser(stages: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rft_core.stages", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=stages, help="the stage program to run")
    p.add_argument("--input", help="the stage input model as a JSON file")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a program argument (repeatable)")
    p.add_argument("--config", help="training config file (YAML) supplying the arguments not given")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of --config (repeatable)")
    p.add_argument("--iteration", type=_iteration, help="the iteration the stage belongs to (fills the input's "
                   "iteration and, below float32, a log-prob pass's grouping from --config)")
    p.add_argument("--out", help="output URI of the stage")
    p.add_argument("--result", help="file to write the returned ShardRef(s) to as JSON")
    return p


def _iteration(text: str) -> int:
    """``--iteration``'s value: an integer >= 1 (argparse reports anything else as a usage error)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an iteration (an integer >= 1)")
    return int(text)


def _raw_input(ns: argparse.Namespace, config_paths: dict[str, str]) -> dict[str, Any] | None:
    """The input fields from --input / --arg / --out / --iteration / --config; None after
    printing a usage error."""
    raw: dict[str, Any] = json.loads(Path(ns.input).read_text()) if ns.input else {}
    for item in ns.arg:
        if "=" not in item:
            print(f"--arg {item!r} must look like NAME=VALUE", file=sys.stderr)
            return None
        name, value = item.split("=", 1)
        raw[name.strip()] = _parse_value(value)
    if ns.out is not None:
        raw["out"] = ns.out
    if ns.iteration is not None:
        has_field = "iteration" in INPUTS[ns.stage].model_fields
        if not has_field and "logprob_grouping" not in config_paths.values():
            print(f"--iteration: {ns.stage} does not take it (no iteration field, nothing per iteration in --config); "
                  "give its fields with --arg (e.g. ppo_update's policy_version)", file=sys.stderr)
            return None
        if has_field:
            raw.setdefault("iteration", ns.iteration)
    if ns.config is not None or ns.set:
        cfg = load_config(ns.config, ns.set)
        for name, path in config_paths.items():
            if name in raw:
                continue
            if path == "logprob_grouping":  # per iteration: the rows of that iteration's update
                if ns.iteration is None and cfg.logprob_grouping is not None:
                    print(f"{ns.stage}: policy.dtype is {cfg.policy.dtype}: give --iteration K (below float32 the "
                          "pass packs the rows of iteration K's update, which shuffles with its policy version), "
                          "or --arg grouping=...", file=sys.stderr)
                    return None
                value = cfg.logprob_grouping_at(1 if ns.iteration is None else ns.iteration)
            else:
                value = operator.attrgetter(path)(cfg)
            raw[name] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
    return raw


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the stage program, write its result; returns the exit status."""
    from pydantic import ValidationError

    ns = _parser(list(PROGRAMS)).parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    prefix = f"[rank {rank}/{world}] " if world > 1 else ""
    logging.basicConfig(level=os.environ.get("RFT_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")
    if world > 1 and ns.stage not in DISTRIBUTED_STAGES:
        print(f"stage {ns.stage!r} runs on one rank only (WORLD_SIZE={world}); several ranks: "
              f"{sorted(DISTRIBUTED_STAGES)}", file=sys.stderr)
        return 2
    raw = _raw_input(ns, dict(INPUTS[ns.stage].config_paths))
    if raw is None:
        return 2
    try:
        inp = input_from_args(ns.stage, raw)
    except ValidationError as exc:
        print(f"stage {ns.stage!r}: bad input (give --input FILE, --arg NAME=VALUE, --out or --config):\n{exc}",
              file=sys.stderr)
        return 2
    configure_cuda_backends()  # TF32 matmuls on CUDA (a no-op on CPU)
    result = PROGRAMS[ns.stage](inp)
    wait_for_optimizer_writes()  # a background optimizer-state write commits before the process exits
    text = encode_result(ns.stage, result)
    if ns.result and rank == 0:
        tmp = Path(ns.result).with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, ns.result)
    logging.getLogger("rft_core.stages").info("%s committed: %s", ns.stage, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
